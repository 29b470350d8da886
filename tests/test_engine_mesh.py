"""The engine and offload on (dp, sp) meshes, real gloo ranks, a real safetensors checkpoint (6 heads: sp 2, 3).

(dp, sp) in {(1, 2), (2, 1), (1, 3), (2, 2)} x {allgather with shard group world, dp (and sp on the 2 x 2
mesh), rank-local}: on every rank the offloaded model's latents for its replica's request are ``torch.equal``
to the single-process resident model's, each rank holds the shard its group gives it, and the engine's
waves (one request per replica, the sp ranks of a replica sharing it, an idle replica in the partial wave)
give every request the resident SHA-256. On the 2 x 2 mesh, LoRA adapters loaded after offload: each replica
runs its own adapter, and continuous serving mixes adapters, every output the resident model's with the same
adapter. One spawn per world size runs all of its cases in sequence. Then a rank that raises or stalls between
all-to-alls fails its wave closed within the timeouts, naming it. (The checkpoint, ``six_heads``, is a session
fixture of conftest; the spawns are shared, conftest.SCENARIOS.)"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import tempfile
import time

import pytest
import torch
from conftest import scenario

from dlo_fn.models import CONFIGS, Request, generate
from dlo_fn.models.lora import load_adapter, write_adapter
from dlo_fn.models.sp import sp_of
from dlo_fn.runtime.dist import DistContext, init_distributed
from dlo_fn.runtime.platform import platform_for
from dlo_fn.serve.batch import Fault
from dlo_fn.serve.local import Phase, open_model, serve_local
from dlo_fn.serve.requests import EngineOptions, as_submissions

pytestmark = pytest.mark.slow

SIX_HEADS = dataclasses.replace(CONFIGS["tiny"], name="tiny-6-heads", hidden_dim=96, num_heads=6)
SHAPES = {2: ((1, 2), (2, 1)), 3: ((1, 3),), 4: ((2, 2),)}
SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=3.0)  # 8 tokens: sp 3 pads
REQUESTS = tuple(Request(prompt=p, seed=s, **SHAPE) for s, p in enumerate(("a fox", "an owl", "a cat")))
SUBS = tuple(as_submissions(REQUESTS))


def _cases(dp: int, sp: int) -> tuple[tuple[str, str], ...]:
    cases = (("allgather", "world"), ("allgather", "dp"), ("rank-local", "world"))
    return cases + ((("allgather", "sp"),) if dp > 1 and sp > 1 else ())


@pytest.fixture(scope="module")
def expected(six_heads):
    model, _ = open_model(six_heads, init_distributed(platform_for("cpu")), "resident")
    return [generate(model, r) for r in REQUESTS]


@torch.no_grad()
def _rank(ctx: DistContext, checkpoint: str) -> dict:
    from dlo_fn.runtime.mesh import build_mesh
    from dlo_fn.serve.engine import Engine

    out: dict = {}
    options = EngineOptions(timeout_s=60.0, progress=False, serving="strict")  # waves over the replicas
    for dp, sp in SHAPES[ctx.world_size]:
        mesh = build_mesh(ctx, sp=sp)
        for mode, group in _cases(dp, sp):
            model, off = open_model(checkpoint, ctx, mode, mesh=mesh, shard_group=group)
            got = generate(model, REQUESTS[mesh.dp_rank], sp=sp_of(mesh))  # replicas in lockstep, one request each
            engine = Engine(model, off, ctx, options, session=f"{dp}x{sp}-{mode}-{group}", mesh=mesh)
            report = engine.run(SUBS[: dp + 1])  # one more request than replicas: a partial wave
            out[(dp, sp, mode, group)] = {
                "latents": got.latents,
                "coordinate": mesh.coordinate,
                "num_shards": off.layout.num_shards,
                "shard_rank": off.shards.rank,
                "arena_bytes": off.store.arena_bytes,
                "report": report,
            }
            if (dp, sp, mode, group) == (2, 2, "allgather", "world"):  # the ring's minimum, for the budget below
                minimum, largest = off.device_weight_bytes, max(off.spec.block_bytes)
    if ctx.world_size == 4:  # an HBM budget on the 2 x 2 mesh: one block resident on every rank, the rest sharded
        budget = minimum + largest
        model, off = open_model(checkpoint, ctx, "allgather", mesh=mesh, hbm_budget=budget)
        got = generate(model, REQUESTS[mesh.dp_rank], sp=sp_of(mesh))
        engine = Engine(model, off, ctx, options, session="2x2-budget", mesh=mesh)
        out["budget"] = {
            "latents": got.latents,
            "report": engine.run(SUBS[:3]),
            "resident": off.resident_blocks,
            "within": minimum < off.device_weight_bytes <= budget,
            "arena_is_planned": off.store.arena_bytes == off.layout.shard_bytes_per_rank,
        }
    return pickle.dumps(out)  # plain bytes: a tensor through the queue would live in shared memory the rank frees


@torch.no_grad()
def _fp8_rank(ctx: DistContext, checkpoint: str) -> bytes:
    """FP8 shards on the 2 x 2 mesh: every shard group and rank-local, one request per replica in lockstep, and
    the engine's strict and continuous serving of three requests."""
    from dlo_fn.runtime.mesh import build_mesh
    from dlo_fn.serve.engine import Engine

    out: dict = {}
    mesh = build_mesh(ctx, sp=2)
    for mode, group in _cases(2, 2):
        model, off = open_model(checkpoint, ctx, mode, mesh=mesh, shard_group=group, quantization="fp8")
        got = generate(model, REQUESTS[mesh.dp_rank], sp=sp_of(mesh))
        reports = {}
        for serving in ("strict", "continuous"):
            options = EngineOptions(timeout_s=60.0, progress=False, serving=serving)
            engine = Engine(model, off, ctx, options, session=f"fp8-{mode}-{group}-{serving}", mesh=mesh)
            reports[serving] = engine.run(SUBS)
        out[(mode, group)] = {
            "latents": got.latents,
            "reports": reports,
            "arena_bytes": off.store.arena_bytes,
            "planned_bytes": off.layout.shard_bytes_per_rank,
        }
    return pickle.dumps(out)


@pytest.mark.timeout(600)
def test_fp8_shards_on_a_mesh_and_both_servings_equal_fake_quantised(request, six_heads):
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.runtime.quant import fake_quantize

    model, _ = open_model(six_heads, init_distributed(platform_for("cpu")), "resident")
    fake_quantize(model, BLOCK_PATHS)
    want = [generate(model, r) for r in REQUESTS]
    results = [pickle.loads(r) for r in scenario(request, 4, "engine_mesh_fp8")]
    for mode, group in _cases(2, 2):
        for rank, res in enumerate(results):
            got = res[(mode, group)]
            assert torch.equal(got["latents"], want[rank // 2].latents), (mode, group, rank)
            assert got["arena_bytes"] == got["planned_bytes"]
        for serving, report in results[0][(mode, group)]["reports"].items():
            assert [r.sha256 for r in report.results] == [w.sha256 for w in want], (mode, group, serving)


# Adapters on the 2 x 2 mesh: replica 0 runs adapter a, replica 1 adapter b at 0.5; served: a, b at 0.5 and none.
LORA_REQUESTS = tuple(
    dataclasses.replace(r, lora=n, lora_scale=s) for r, (n, s) in zip(REQUESTS, (("a", 1.0), ("b", 0.5), (None, 1.0)))
)


def _adapters(model, root: pathlib.Path) -> None:
    """Adapters ``a`` and ``b`` written for ``model``'s config (the same bytes on every rank: seeded) and loaded."""
    for i, name in enumerate("ab"):
        path = root / f"{name}.safetensors"
        if not path.exists():
            write_adapter(model, path, rank=4, seed=i)
        load_adapter(model, path, name)


@torch.no_grad()
def _lora_rank(ctx: DistContext, checkpoint: str) -> bytes:
    """On the 2 x 2 mesh (Ulysses sp 2), allgather over the world: adapters loaded after offload, one request per
    replica in lockstep, each replica with its own adapter; then continuous serving of requests with different
    adapters and none."""
    from dlo_fn.runtime.mesh import build_mesh
    from dlo_fn.serve.engine import Engine

    mesh = build_mesh(ctx, sp=2)
    with tempfile.TemporaryDirectory() as tmp:
        model, off = open_model(checkpoint, ctx, "allgather", mesh=mesh, shard_group="world")
        _adapters(model, pathlib.Path(tmp))
        got = generate(model, LORA_REQUESTS[mesh.dp_rank], sp=sp_of(mesh))
        options = EngineOptions(timeout_s=60.0, progress=False, serving="continuous")
        engine = Engine(model, off, ctx, options, session="lora", mesh=mesh)
        report = engine.run(tuple(as_submissions(LORA_REQUESTS)))
    return pickle.dumps({"latents": got.latents, "report": report})


@pytest.mark.timeout(600)
def test_adapters_after_offload_on_a_mesh_equal_resident(request, six_heads, tmp_path):
    model, _ = open_model(six_heads, init_distributed(platform_for("cpu")), "resident")
    _adapters(model, tmp_path)
    want = [generate(model, r) for r in LORA_REQUESTS]
    assert len({w.sha256 for w in want}) == 3  # the adapters change the output
    results = [pickle.loads(r) for r in scenario(request, 4, "engine_mesh_lora")]
    for rank, res in enumerate(results):
        assert torch.equal(res["latents"], want[rank // 2].latents), rank
    assert [r.sha256 for r in results[0]["report"].results] == [w.sha256 for w in want]


@pytest.fixture(params=[2, 3, 4], ids=["world2", "world3", "world4"])
def ranks(request):
    """Every rank's results of :func:`_rank` on ``six_heads`` (the shared spawn of this world size,
    conftest.SCENARIOS)."""
    return request.param, [pickle.loads(r) for r in scenario(request, request.param, "engine_mesh")]


@pytest.mark.timeout(600)
def test_offloaded_latents_equal_resident_on_every_rank(ranks, expected):
    world, results = ranks
    for dp, sp in SHAPES[world]:
        for mode, group in _cases(dp, sp):
            for rank, res in enumerate(results):
                got = res[(dp, sp, mode, group)]
                assert got["coordinate"] == divmod(rank, sp)
                assert torch.equal(got["latents"], expected[rank // sp].latents), (dp, sp, mode, group, rank)


@pytest.mark.timeout(600)
def test_each_rank_holds_its_shard_groups_share(ranks):
    """world: M / (dp sp) per rank; dp: M / dp (the sp partners hold the same shard, as in the reference);
    sp: M / sp; rank-local: whole blocks."""
    world, results = ranks
    for dp, sp in SHAPES[world]:
        for mode, group in _cases(dp, sp):
            for rank, res in enumerate(results):
                got = res[(dp, sp, mode, group)]
                dp_rank, sp_rank = divmod(rank, sp)
                size, index = {"world": (world, rank), "dp": (dp, dp_rank), "sp": (sp, sp_rank)}[group]
                if mode == "rank-local":
                    size, index = 1, 0
                assert (got["num_shards"], got["shard_rank"]) == (size, index), (dp, sp, mode, group, rank)
        arena = {g: results[0][(dp, sp, "allgather", g)]["arena_bytes"] for g in ("world", "dp")}
        whole = results[0][(dp, sp, "rank-local", "world")]["arena_bytes"]
        assert (arena["world"] < arena["dp"]) == (sp > 1) and arena["world"] * world >= whole


@pytest.mark.timeout(600)
def test_engine_waves_over_replicas_give_resident_hashes(ranks, expected):
    world, results = ranks
    for dp, sp in SHAPES[world]:
        for mode, group in _cases(dp, sp):
            report = results[0][(dp, sp, mode, group)]["report"]
            assert all(res[(dp, sp, mode, group)]["report"] is None for res in results[1:])
            assert (report.dp_size, report.sp_size) == (dp, sp)
            assert len(report.results) == dp + 1
            for res, exp in zip(report.results, expected):
                assert res.ok, res.error
                assert torch.equal(res.video, exp.video) and res.sha256 == exp.sha256, (dp, sp, mode, group)
            if mode != "allgather":
                continue
            # One request per replica, written by the replica's sp-rank 0; the partial wave's idle replica
            # only served its shards.
            if dp == 2:
                assert [w.rank_indices for w in report.waves] == [((0,), (1,)), ((2,), ())]
                assert [r.rank for r in report.results] == [0, sp, 0]
            else:
                assert [w.rank_indices for w in report.waves] == [((0,),), ((1,),)]
                assert [r.rank for r in report.results] == [0, 0]


@pytest.mark.timeout(600)
def test_a_budget_on_the_mesh_equals_resident(request, expected):
    """(2, 2), weights sharded over the world, an HBM budget of the ring's minimum plus one block: block 0 stays
    whole on every rank; each rank's latents and the engine's waves equal the resident model's."""
    results = [pickle.loads(r) for r in scenario(request, 4, "engine_mesh")]
    for rank, res in enumerate(results):
        got = res["budget"]
        assert got["resident"] == (0,) and got["within"] and got["arena_is_planned"], (rank, got)
        assert torch.equal(got["latents"], expected[rank // 2].latents), rank
    report = results[0]["budget"]["report"]
    assert [r.sha256 for r in report.results] == [e.sha256 for e in expected]


@pytest.mark.parametrize("kind", ["raise", "stall"])
@pytest.mark.timeout(120)
def test_a_rank_failing_between_all_to_alls_fails_the_wave_closed(six_heads, kind):
    """(1, 2): rank 1 raises (or stalls) after block 0 of step 1; its partner then waits for it in the next
    block's all-to-all. The wave fails closed within the timeouts, naming rank 1; nothing hangs."""
    timeout_s = 3.0
    fault = Fault(rank=1, wave=0, kind=kind, step=1)
    options = EngineOptions(timeout_s=timeout_s, grace_s=1.0, progress=False, fault=fault, serving="strict")
    t0 = time.perf_counter()
    run = serve_local(
        six_heads,
        [Phase("allgather", SUBS[:2], options)],
        1,
        sp_size=2,
        start_method="forkserver",
        join_timeout_s=90,
        grace_s=1,
    )  # after rank 0's answer only a stalled rank 1 is left, to be killed
    wall_s = time.perf_counter() - t0
    (report,) = run.reports
    assert [r.ok for r in report.results] == [False, False]
    first, second = report.results
    assert "wave 0 failed closed" in first.error and "rank 1" in first.error
    if kind == "raise":
        assert "InjectedFault" in first.error
    else:
        assert "rank 1 stalled" in first.error and run.exitcodes[1] == -9  # killed by serve_local after grace
    assert second.error.startswith("not dispatched: the engine stopped earlier")
    assert wall_s < 60, wall_s
