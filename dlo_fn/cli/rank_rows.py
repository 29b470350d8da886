"""The per-rank host rows that `memory` and `plan` print (:mod:`dlo_fn.cost.rank_memory`): the terms, then
RSS / USS / PSS / VmHWM and the sum of PSS over ranks by phase."""

from __future__ import annotations

TERM_FORMULAS = {
    "arena_bytes": "s: the rank's shards (allgather), every block (rank-local), 0 (mmap)",
    "read_bytes": "F: checkpoint bytes read to fill the arena (sum_b n_b / W)",
    "readers": "k: ranks mapping each page of F (1 allgather, N rank-local)",
    "resident_bytes": "R: tensors outside the blocks (read once)",
    "resident_copy_bytes": "R on CPU (a private copy), 0 on an accelerator",
    "warm_bytes": "w: the slot the allgather warm-up writes (CPU host slots)",
    "transient_bytes": "g: gloo's all-gather output copy (CPU), at the peak only",
    "slot_bytes": "n_S x S on the host (CPU), 0 on an accelerator",
    "landing_bytes": "n_L x L on the host (CPU allgather), 0 on an accelerator",
    "streamed_bytes": "blocks read from the mapping while generating (rank-local mmap)",
    "activation_bytes": "a: per-request scratch (workload input)",
    "staging_bytes": "x: collective host staging on an accelerator (gloo; 0 for NCCL)",
}


def rank_memory_doc(sizes, num_ranks: int, mode: str, device: str, constant_bytes: int, **kwargs) -> dict:
    """JSON-ready per-rank model; the constant ``c`` is taken as RSS = USS = PSS = ``constant_bytes`` (give a
    measured value: ``bench load --phases`` reads the three apart)."""
    from dlo_fn.cost.rank_memory import ProcessConstant, rank_memory

    m = rank_memory(
        sizes,
        num_ranks,
        mode,
        device,
        constant=ProcessConstant(constant_bytes, constant_bytes, constant_bytes),
        **kwargs,
    )
    return {
        "num_ranks": num_ranks,
        "mode": mode,
        "device": device,
        "constant_bytes": constant_bytes,
        "terms": dict(m.terms.items()),
        "phases": [
            {
                "phase": p.phase,
                "rss_bytes": p.rss_bytes,
                "uss_bytes": p.uss_bytes,
                "pss_bytes": p.pss_bytes,
                "hwm_bytes": p.hwm_bytes,
                "sum_pss_bytes": p.sum_pss_bytes,
            }
            for p in m.phases
        ],
    }


def print_rank_memory(doc: dict) -> None:
    print(
        f"\nhost per rank ({doc['mode']}, {doc['num_ranks']} rank(s) on the host, {doc['device']}; "
        f"c = {doc['constant_bytes'] / 1e9:.3f} GB)"
    )
    for name, value in doc["terms"].items():
        text = str(value) if name == "readers" else f"{value / 1e9:9.3f} GB"
        print(f"  {name:22s} {TERM_FORMULAS[name]:66s} {text:>12s}")
    print(f"  {'phase':10s} {'RSS':>10s} {'USS':>10s} {'PSS':>10s} {'VmHWM':>10s} {'sum PSS':>10s}")
    for p in doc["phases"]:
        print(
            f"  {p['phase']:10s} "
            + " ".join(
                f"{p[k] / 1e9:7.3f} GB" for k in ("rss_bytes", "uss_bytes", "pss_bytes", "hwm_bytes", "sum_pss_bytes")
            )
        )
