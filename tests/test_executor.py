"""Executor in one process (W = 1, CPU): bit-exactness, the memory bound, views built once, schedule checks,
explicit runs (R requests, compute=False), the measured timeline."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

import dlo_fn.runtime.blocks as blocks_mod
from dlo_fn.plan.schedule import Ring, build_schedule
from dlo_fn.plan.trace import from_chrome_trace, to_chrome_trace
from dlo_fn.runtime.blocks import BlockProxy
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.executor import ScheduleError
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.platform import platform_for

CTX = DistContext(0, 1, 0, platform_for("cpu"), None)


class ToyBlock(nn.Module):
    """kwargs, a tuple return, a tied weight, mixed dtypes and a non-persistent buffer: the awkward cases."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.gate = nn.Linear(d, d, bias=False).to(torch.bfloat16)
        self.gate_again = nn.Linear(d, d, bias=False)
        self.gate_again.weight = self.gate.weight  # tied
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("table", torch.linspace(0, 1, d), persistent=False)

    def forward(self, x: torch.Tensor, *, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.down(torch.relu(self.up(self.norm(x)))) * self.scale + self.table
        g = self.gate_again(x.to(torch.bfloat16)).float()
        return x + h * torch.sigmoid(g), ctx * 0.9


class ToyDiT(nn.Module):
    def __init__(self, d: int = 16, num_blocks: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(ToyBlock(d) for _ in range(num_blocks))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, ctx = self.embed(x), x
        for block in self.blocks:
            x, ctx = block(x, ctx=ctx)
        return self.head(x + ctx)


def toy(num_blocks: int = 5, seed: int = 0, d: int = 16) -> ToyDiT:
    torch.manual_seed(seed)
    return ToyDiT(d=d, num_blocks=num_blocks).eval().requires_grad_(False)


@pytest.mark.parametrize(
    "mode,opts",
    [
        ("allgather", {}),
        ("allgather", {"block_call": "swap"}),
        ("allgather", {"num_slots": 3, "num_landing": 1}),
        ("rank-local", {}),
        ("rank-local", {"rank_local_source": "mmap"}),
        ("rank-local", {"num_slots": 1}),
        ("resident", {}),
        ("rank-local", {"num_slots": 4, "load_group": 2}),
        ("allgather", {"num_slots": 6, "load_group": 3}),  # W = 1: the rank-local sequence, so load groups apply
    ],
)
def test_offloaded_equals_resident_over_passes(mode, opts):
    ref = toy()
    o = offload(copy.deepcopy(ref), "blocks", CTX, mode=mode, **opts)
    for seed in range(4):  # several passes = several denoising steps / requests on one ring
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(o.model(x), ref(x))
    if mode != "resident":
        assert o.executor.stats.computes == 4 * 5 and o.executor.stats.runs == 4
        assert all(isinstance(b, BlockProxy) for b in o.model.blocks)


def test_weight_device_bytes_independent_of_depth():
    sizes = {}
    for n in (4, 16):
        o = offload(toy(n), "blocks", CTX)
        ex = o.executor
        sizes[n] = ex.device_weight_bytes
        # allgather over one rank lowers to H2D straight into the slot: slots only, no landing buffer
        assert ex.mode == "allgather" and ex.ring.mode == "rank-local" and ex.landing == ()
        assert ex.device_weight_bytes == ex.planned_device_weight_bytes == 2 * o.layout.max_padded_block_bytes
        assert o.store.arena_bytes == o.layout.shard_bytes_per_rank == n * o.layout.shards[0].shard_bytes
    assert sizes[4] == sizes[16]


def test_print_says_what_offload_set_up():
    from dlo_fn.io.memstat import format_bytes

    o = offload(toy(4), "blocks", CTX, mode="rank-local", num_slots=3)
    first, how = str(o).splitlines()
    assert first.startswith("ToyDiT: rank-local, 4 blocks, whole blocks copied from this rank's host store; 3 device")
    assert f"device weights {format_bytes(o.device_weight_bytes)} on cpu" in first and "load group 1;" in first
    assert how == "set by the caller (no auto field)" and repr(o) == f"Offloaded({o})"
    assert str(offload(toy(4), "blocks", CTX, mode="resident")).startswith("ToyDiT: resident, 4 blocks (")


def test_blocks_lose_their_storage_and_views_are_built_once(monkeypatch):
    calls = []
    real = blocks_mod.make_views
    monkeypatch.setattr(blocks_mod, "make_views", lambda *a: calls.append(1) or real(*a))
    o = offload(toy(6), "blocks", CTX, num_slots=2)
    assert len(calls) == 2 and o.executor.num_view_sets == 2  # one set per slot: all blocks share a layout
    for proxy in o.model.blocks:
        for name, t in list(proxy.block.named_parameters()) + list(proxy.block.named_buffers()):
            # a stand-in holds one element (the non-persistent table stays real)
            assert t.untyped_storage().nbytes() == t.element_size() or name == "table", name
    for _ in range(5):
        o.model(torch.randn(2, 16))
    assert len(calls) == 2
    assert len(o.executor._programs) <= 2  # cold start + the warm ring (6 blocks on 2 slots: one offset)


def test_wrong_block_order_is_an_error_and_the_ring_recovers():
    ref = toy()
    o = offload(copy.deepcopy(ref), "blocks", CTX)
    x = torch.randn(2, 16)
    with pytest.raises(ScheduleError, match=r"block 2 .*expects block 0"):
        o.model.blocks[2](x, ctx=x)
    assert not o.executor.in_run
    assert torch.equal(o.model(x), ref(x))  # cold restart, still exact
    with pytest.raises(ScheduleError, match="fewer blocks"):
        with o.run(num_steps=1):
            o.model.blocks[0](x, ctx=x)
    assert torch.equal(o.model(x), ref(x))


def test_explicit_runs_block_major_requests_and_idle_passes():
    ref = toy()
    o = offload(copy.deepcopy(ref), "blocks", CTX)
    xs = [torch.randn(2, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    with o.run(num_steps=2, requests_per_load=3) as schedule:
        assert schedule.requests_per_load == 3 and schedule.num_steps == 2
        for _step in range(2):
            hs = [(o.model.embed(x), x) for x in xs]
            for block in o.model.blocks:  # block-major: one load serves the three requests
                hs = [block(h, ctx=c) for h, c in hs]
            outs = [o.model.head(h + c) for h, c in hs]
            for x, out in zip(xs, outs):
                assert torch.equal(out, ref(x))
    loads_before = o.executor.stats.loads
    o.executor.idle(num_steps=2)  # serve the loads of a 2-step run without computing
    assert o.executor.stats.loads - loads_before == 2 * 5
    assert torch.equal(o.model(xs[0]), ref(xs[0]))
    with pytest.raises(ScheduleError, match="compute=False"):
        with o.run(compute=False):
            o.model(xs[0])


def test_drain_after_a_failed_compute_keeps_the_ring():
    ref = toy()
    o = offload(copy.deepcopy(ref), "blocks", CTX)
    x = torch.randn(2, 16)
    loads = o.executor.stats.loads
    o.executor.begin_run(num_steps=2)
    o.model.blocks[0](x, ctx=x)
    with pytest.raises(RuntimeError):
        o.model.blocks[1](torch.randn(2, 3), ctx=x)  # the block itself fails (bad shape)
    o.executor.drain()  # the rest of the run's loads are still issued (collectives stay in step)
    assert not o.executor.in_run and o.executor.stats.loads - loads == 2 * 5 + 1  # cold run + 1 prefetched
    assert torch.equal(o.model(x), ref(x))


def test_handed_schedules_run_and_ones_off_the_ring_are_refused():
    ref = toy()
    o = offload(copy.deepcopy(ref), "blocks", CTX)
    ex, x = o.executor, torch.randn(2, 16)
    assert ex.ring == Ring.cold(5, num_shards=1) == Ring.cold(5, mode="rank-local")  # one rank: the rank-local ring
    handed = ex.ring.next_schedule(1, prefetch_next=False)  # the caller, not the executor, decides
    with o.run(schedule=handed) as followed:
        assert followed is handed
        assert torch.equal(o.model(x), ref(x))
    assert ex.ring == Ring(5, 2, 0, "rank-local", slot_offset=1, warm=False)
    with pytest.raises(ScheduleError, match=r"slot_offset = 0 \(the ring has 1\)"):
        ex.begin_run(schedule=build_schedule(5, 1))  # a cold schedule on a ring that has moved on
    with pytest.raises(ScheduleError, match="pass the schedule alone"):
        ex.begin_run(2, schedule=ex.ring.next_schedule(1))
    broken = ex.ring.next_schedule(1)
    with pytest.raises(ScheduleError, match="before op"):  # checked in full before its first run
        ex.begin_run(schedule=dataclasses.replace(broken, deps=((),) * len(broken.ops)))
    assert not ex.in_run and ex.stats.runs == 1
    assert torch.equal(o.model(x), ref(x))  # an implicit run on the ring's own next schedule, still exact
    assert ex.ring.warm


def test_measured_timeline_matches_schedule_and_exports_trace(tmp_path):
    o = offload(toy(4), "blocks", CTX, record_timeline=True)
    schedules = []
    for _ in range(2):
        schedules.append(o.executor.next_schedule())
        o.model(torch.randn(2, 16))
    tl = o.executor.take_timeline()
    want = [f"run{j} {op}" for j, s in enumerate(schedules) for op in s.to_strs()]
    assert [s.op for s in tl.spans] == want
    assert {s.stream for s in tl.spans} == {"h2d", "compute"}  # one rank: no all-gather (W > 1: test_executor_dist)
    assert dict(tl.meta)["mode"] == "rank-local" and dict(tl.meta)["num_landing"] == "0"
    assert all(s.end_s >= s.start_s >= 0 for s in tl.spans)
    computes = [s for s in tl.spans if s.stream == "compute"]
    assert all(a.end_s <= b.start_s for a, b in zip(computes, computes[1:]))
    assert dict(tl.meta)["source"] == "measured"
    assert o.executor.timeline_origin_s is not None  # CPU: spans are on the host clock
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(to_chrome_trace(tl)))
    assert from_chrome_trace(json.loads(path.read_text())) == tl


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["allgather", "rank-local"])
@torch.no_grad()
def test_cuda_streams_events_bit_exact(mode):
    """Real copy / communication / compute streams ordered only by events: blocks large enough that a missing
    wait would let a compute read a slot still being written (or overwritten)."""
    cuda = platform_for("cuda", 0)
    ctx = DistContext(0, 1, 0, cuda, None)
    ref = toy(8, d=1024).to("cuda")
    o = offload(toy(8, d=1024), "blocks", ctx, mode=mode)
    assert o.store.how == "cudaHostRegister" and o.store.arena.is_pinned()
    xs = [torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(6)]
    want = [ref(x) for x in xs]
    got = [o.model(x) for x in xs]  # six passes back to back, no host synchronisation in between
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    ex = o.executor
    assert ex.ring.mode == "rank-local" and ex.landing == ()  # W = 1: no landing buffer, no all-gather
    assert ex.measured_device_bytes >= ex.planned_device_weight_bytes
    assert ex.measured_device_bytes <= 1.05 * ex.planned_device_weight_bytes + 2 * 2**20


def test_one_block_too_many_is_an_error_and_the_ring_restarts():
    ref = toy()
    o = offload(copy.deepcopy(ref), "blocks", CTX)
    x = torch.randn(2, 16)
    with pytest.raises(ScheduleError, match="computes are all done"):
        with o.run(1):
            o.model(x)
            o.model.blocks[0](x, ctx=x)
    assert torch.equal(o.model(x), ref(x))  # the ring restarted cold


@pytest.mark.parametrize("block_call", ["swap", "functional_call"])
def test_load_groups_cut_the_stream_ops_per_block(block_call):
    # A run of T passes: one load per block makes 5 stream operations per block (the H2D, its wait and record,
    # the compute's wait and record); groups of G make 5 per G blocks: one wait, one copy (the slots are one
    # allocation and the arena holds consecutive blocks back to back, so the G copies join), one record on each
    # stream. At the run's boundary the S slots' first uses each wait on the previous run (at most 2 S operations
    # more per run); a run prefetches whole groups, so one copy per group. Bit-exact either way.
    ref, B, T = toy(8), 8, 6
    for g in (1, 2, 4):
        o = offload(
            copy.deepcopy(ref), "blocks", CTX, mode="rank-local", block_call=block_call, num_slots=2 * g, load_group=g
        )
        stats = o.executor.stats
        for _ in range(2):  # cold, then warm implicit runs
            o.model(torch.randn(2, 16))
        ops, copies = stats.stream_ops, stats.copies
        with o.run(T):
            for _ in range(T):
                x = torch.randn(2, 16)
                assert torch.equal(o.model(x), ref(x))
        per_block = (stats.stream_ops - ops) / (T * B)
        copies_per_block = (stats.copies - copies) / (T * B)
        if g == 1:
            assert (per_block, copies_per_block) == (5.0, 1.0)
        else:
            assert 5 / g < per_block <= 5 / g + 2 * (2 * g) / (T * B), (g, per_block)
            assert copies_per_block == 1 / g, (g, copies_per_block)


@torch.no_grad()
def test_load_groups_with_requests_and_a_partly_pinned_store():
    # Two requests per load (each block computed twice in a row: only the last compute of a slot's occupant is
    # waited on, so the first one records nothing), runs of 1 and 3 steps on the ring, and a host budget that pins
    # three blocks: the other four are copied from the module's own (pageable) tensors, whose bytes do not continue
    # the arena's, so their copies stay apart.
    ref = toy(7)
    sizes = [s.shard_bytes for s in offload(toy(7), "blocks", CTX, mode="rank-local").layout.shards]
    o = offload(
        copy.deepcopy(ref),
        "blocks",
        CTX,
        mode="rank-local",
        num_slots=6,
        load_group=3,
        pinned_budget_bytes=sum(sizes[:3]),
    )
    assert o.store.num_pinned_blocks == 3

    def steps(model, num_steps, x0):
        xs, cs = list(x0), list(x0)
        for _ in range(num_steps):
            for block in model.blocks:
                for r in range(2):
                    xs[r], cs[r] = block(xs[r], ctx=cs[r])
        return xs + cs

    for num_steps in (1, 3, 1):
        x0 = [torch.randn(2, 16) for _ in range(2)]
        want = steps(ref, num_steps, x0)
        with o.run(num_steps, 2):
            got = steps(o.model, num_steps, x0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert o.executor.stats.copies > 0 and o.executor.stats.computes == 5 * 7 * 2


def test_release_gives_back_the_buffers_and_refuses_to_run():
    import gc
    import weakref

    o = offload(toy(), "blocks", CTX, mode="allgather")
    x = torch.randn(3, 16)
    o.model(x)  # compiled programs and callers now hold views into the slots
    slots = [weakref.ref(t) for t in o.executor.slots]  # W = 1: no landing buffers (plan.lowering)
    o.executor.release()
    gc.collect()
    assert slots and all(ref() is None for ref in slots) and o.executor.landing == ()
    with pytest.raises(ScheduleError, match="this executor was released"):
        o.model(x)


def test_load_group_options_are_checked():
    from dlo_fn.runtime.offload import OffloadOptions

    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="load_group must be an int >= 1"):
            OffloadOptions(load_group=bad)
    slots = "load_group = 2 needs num_slots a multiple of it and >= 4.*pass num_slots = 4"
    with pytest.raises(ValueError, match=slots):
        OffloadOptions(load_group=2)
    assert OffloadOptions(load_group=2, num_slots=6).load_group == 2
    # allgather over 2 ranks: the ring checks the landing buffers (a group's shards side by side), default 2G
    with pytest.raises(ValueError, match="num_landing a multiple of it.*got num_landing = 3"):
        Ring.cold(4, num_slots=4, num_landing=3, mode="allgather", num_shards=2, load_group=2)
    assert Ring.cold(4, num_slots=4, mode="allgather", num_shards=2, load_group=2).num_landing == 4


@pytest.mark.parametrize("load_group", [1, 2])
@torch.no_grad()
def test_generic_loop_records_only_what_is_waited_on(monkeypatch, load_group):
    # The issue loop (the one path on CPU, CUDA and NPU): an op records its event only if a
    # later op of the run or the next run waits on it, and every wait is on an event recorded in this run (a
    # dependency) or in the previous one (a carried last use): never on a stale record.
    from dlo_fn.runtime.platform import HostEvent, HostStream

    ref = toy(8)
    o = offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", num_slots=2 * load_group, load_group=load_group)
    ex = o.executor
    now: set[int] = set()
    carried: set[int] = set()
    records = []
    record, wait = HostEvent.record, HostStream.wait_event

    def counted_record(self, stream=None):
        now.add(id(self))
        records.append(id(self))
        return record(self, stream)

    def checked_wait(self, event):
        assert id(event) in now or id(event) in carried, "a wait on an event not recorded in this run"
        return wait(self, event)

    begin = ex.begin_run

    def begin_run(*args, **kwargs):
        carried.clear()
        carried.update(id(e) for e in ex._carry.values() if id(e) in now)
        now.clear()
        return begin(*args, **kwargs)

    monkeypatch.setattr(HostEvent, "record", counted_record)
    monkeypatch.setattr(HostStream, "wait_event", checked_wait)
    monkeypatch.setattr(ex, "begin_run", begin_run)
    for _ in range(4):
        x = torch.randn(2, 16)
        assert torch.equal(o.model(x), ref(x))
    records.clear()
    with o.run(3):
        for _ in range(3):
            x = torch.randn(2, 16)
            assert torch.equal(o.model(x), ref(x))
    program = next(p for p in ex._programs.compiled() if p.schedule.num_steps == 3)
    assert len(records) == sum(op.recorded for op in program.ops) <= len(program.ops)
    per_block = len(records) / (3 * 8)  # one load per block: every H2D and compute is waited on
    assert per_block == 2.0 if load_group == 1 else per_block < 1.2, per_block


def test_a_grouped_layout_compiles_only_whole_group_gathers():
    # The grouped shard layout (plan.layout) gathers a group in ONE all-gather: compiled against it, the ring's
    # schedule of that group joins each group's AGs into one pair of the group's bytes; a schedule whose groups are
    # not the layout's (one load per block, or groups shifted by a slot) is refused, naming the op.
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import block_state
    from dlo_fn.runtime.host_store import build_host_store
    from dlo_fn.runtime.program import compile_schedule
    from dlo_fn.runtime.slots import SlotBuffers

    model = toy(4)
    layout = model_layout(spec_from_module(model, "blocks"), 2, load_group=2)
    store = build_host_store(layout, 0, [block_state(b)[0] for b in model.blocks], platform_for("cpu"))
    buffers = SlotBuffers(platform_for("cpu"), layout, 4, 4)  # the executor's placement of a group's blocks

    def compile_(schedule):
        return compile_schedule(
            schedule, layout, store, buffers, [[None] * 4 for _ in range(4)], (None, None), lambda: None
        )

    ring = Ring.cold(4, num_slots=4, mode="allgather", num_shards=2, load_group=2)
    program = compile_(ring.next_schedule(2))
    pairs = [op.pairs for op in program.ops if op.kind == "AG" and op.pairs]
    assert pairs and all(len(a) == 1 and a[0][1].numel() == 2 * layout.shards[0].shard_bytes for a in pairs)
    with pytest.raises(ScheduleError, match="not one whole group's"):
        compile_(build_schedule(4, 1, num_slots=4, num_landing=4, mode="allgather"))
    with pytest.raises(ScheduleError, match="not one whole group's"):
        compile_(build_schedule(4, 1, num_slots=4, num_landing=4, mode="allgather", slot_offset=1, load_group=2))
