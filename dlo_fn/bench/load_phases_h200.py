"""Turn the H200 rank-memory samples (`figures/data/load_phases_h200.jsonl`) into the phase CSV with the plan's
prediction: `python -m dlo_fn.bench.load_phases_h200 JSONL CHECKPOINT OUT.csv`.

The samples were taken on one H200 (torch 2.11, 2026-12-01) by a compact script equivalent to
:func:`dlo_fn.bench.load_phases.rank_phases` at phases load / offload / generate (no fill sample: it ran the
main branch's runtime, which on CUDA already drops every view when the resident tensors move to the device),
N gloo ranks sharing the GPU: memory only, no timing. The constant is each run's ``load`` row; on CUDA the
allgather rows add gloo's pinned staging (:func:`dlo_fn.plan.rank_memory.gloo_cuda_staging_bytes`).
"""

from __future__ import annotations

import json
import sys

from dlo_fn.bench.load_phases import PHASE_FIELDS

MACHINE = "NVIDIA H200 (1 GPU, 16 cores, torch 2.11.0+cu130); N ranks share the GPU over gloo (memory only)"
COMMAND = ("per-rank sampler (load_phases.rank_phases without the fill hook) over dlo_fn main 1d0e3cc, "
           "load-200mb checkpoint; then python -m dlo_fn.bench.load_phases_h200")


def rows_from_samples(lines, checkpoint: str) -> list[dict]:
    from dlo_fn.plan.rank_memory import ProcessConstant, gloo_cuda_staging_bytes, rank_memory
    from dlo_fn.plan.sizes import ModelSizes
    from dlo_fn.io.sources import spec_for

    sizes = ModelSizes.from_spec(spec_for(checkpoint))
    runs: dict[tuple[str, int], list[dict]] = {}
    for line in lines:
        x = json.loads(line)
        runs.setdefault((x["mode"], x["n"]), []).append(x)
    rows = []
    for (mode, n), ranks in runs.items():
        sums: dict[str, int] = {}
        for x in ranks:
            for tag, *v in x["samples"]:
                sums[tag] = sums.get(tag, 0) + v[2]
        for x in sorted(ranks, key=lambda x: x["rank"]):
            s = {tag: v for tag, *v in x["samples"]}
            staging = gloo_cuda_staging_bytes(sizes, n) if mode == "allgather" else 0
            plan = rank_memory(sizes, n, mode, "cuda", constant=ProcessConstant(*s["load"][:3]),
                               staging_bytes=staging)
            for p in plan.phases:
                if p.phase not in s:
                    continue
                rss, uss, pss, hwm, file_rss = s[p.phase]
                rows.append({"machine": MACHINE, "checkpoint": "load-200mb bf16, 215.86 MB", "command": COMMAND,
                             "date": "2026-12-01", "device": "cuda", "mode": mode, "ranks": n, "phase": p.phase,
                             "rss_bytes": rss, "uss_bytes": uss, "pss_bytes": pss, "hwm_bytes": hwm,
                             "sum_pss_bytes": sums[p.phase], "file_rss_bytes": file_rss,
                             "predicted_rss_bytes": p.rss_bytes, "predicted_uss_bytes": p.uss_bytes,
                             "predicted_pss_bytes": p.pss_bytes, "predicted_hwm_bytes": p.hwm_bytes,
                             "predicted_sum_pss_bytes": p.sum_pss_bytes, "arena_bytes": x["arena"],
                             "pinned_bytes": x["pinned"], "planned_arena_bytes": x["planned"], "rank": x["rank"]})
    return rows


if __name__ == "__main__":
    from dlo_fn.figures.style import write_csv

    src, ckpt, out = sys.argv[1:4]
    write_csv(out, rows_from_samples(open(src).read().splitlines(), ckpt), PHASE_FIELDS + ("rank",))
