"""The cost models under an HBM budget (dlo_fn.cost.hbm_budget) against the runtime, to the byte: the resident set,
the device weight bytes and the pinned bytes that `memory` and the policy's row give are what `offload(hbm_budget=)`
holds, BF16 and FP8, from the two-slot minimum to the whole model. (2 gloo ranks in allgather mode:
test_executor_dist's and test_quant's budget paths.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_executor_dist import load_reference

from dlo_fn.cli import main
from dlo_fn.cost import topology_file
from dlo_fn.cost.accounting import memory_accounting
from dlo_fn.cost.hbm_budget import resident_plan
from dlo_fn.cost.policy import Candidate, plan, predict
from dlo_fn.cost.topology import PolicyModel
from dlo_fn.models import BLOCK_PATHS
from dlo_fn.plan.resident import BudgetError
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.runtime.dist import init_distributed
from dlo_fn.runtime.offload import offload


def runtime_matches_cost(o, budget: int, quantization: str | None, num_shards: int) -> dict:
    """What the cost models say of an offloaded model ``o`` (built with ``hbm_budget=budget`` on a shard group of
    ``num_shards`` ranks) against what it holds; every value True. Shared with the multi-rank budget paths."""
    sizes = ModelSizes.from_spec(o.spec, quantization=quantization)  # offload's spec (on CPU: its address residues)
    mode = "allgather" if o.mode == "allgather" else "rank-local"
    landing = (o.executor.num_landing if o.executor is not None else 0) or 2  # W = 1: none, lowered
    ring = dict(num_slots=o.options.num_slots, num_landing=landing)
    kept = resident_plan(sizes, budget, num_shards=num_shards, mode=mode, tensor_block_bytes=o.spec.block_bytes, **ring)
    rows = memory_accounting(
        sizes,
        num_shards,
        mode=mode,
        **ring,
        framework_bytes_per_rank=0,
        context_bytes=0,
        budget=kept,
    )
    value = {(r.section, r.item): r.value_bytes for r in rows}
    pinned = o.store.arena_bytes if o.store is not None else 0
    # A link-bound machine: the policy's placement by compute then keeps the most within the budget, as offload's
    # placement by bytes does (the same resident set, so the same buffers to compare); its device copies no faster
    # than the link, so no shard is worth keeping on the device (placed by bytes, offload keeps none).
    top = dataclasses.replace(
        topology_file.topology("1xH200"), num_ranks=num_shards, h2d_bytes_per_s=1e3, d2d_copy_bytes_per_s=1e3
    )
    model = PolicyModel(sizes, 64, tensor_block_bytes=o.spec.block_bytes)
    w = num_shards if mode == "allgather" else 1
    group = "mesh" if mode == "allgather" else "-"
    cand = Candidate(num_shards, 1, mode, group, o.options.num_slots, 1, landing if w > 1 else 0)
    row = predict(model, top, topology_file.workload("image 1024^2 CFG, 24 steps"), cand, hbm_budget=budget)
    return {
        "resident_set": kept.resident == o.resident_blocks == row.resident,
        "memory_device_weights": value[("hbm per card", "device weights")] == o.device_weight_bytes,
        "memory_resident_blocks": value[("hbm per card", "resident blocks")]
        == sum(o.spec.blocks[b].nbytes for b in o.resident_blocks),
        "memory_pinned": value[("host: steady state", "pinned per rank")] == pinned,
        "policy_device_weights": row.hbm_bytes == o.device_weight_bytes <= budget == row.hbm_capacity_bytes,
        "policy_pinned": row.host_bytes - top.framework_host_bytes == pinned,
    }


@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_memory_and_policy_price_the_budget_to_the_byte(capsys, tiny_checkpoint, mode, quantization):
    ctx = init_distributed()

    def build(budget=None):
        return offload(
            load_reference(tiny_checkpoint), BLOCK_PATHS, ctx, mode=mode, quantization=quantization, hbm_budget=budget
        )

    streamed = build()
    sizes = ModelSizes.from_spec(streamed.spec, quantization=quantization)
    larger = resident_plan(
        sizes, streamed.device_weight_bytes, num_shards=1, mode=mode, tensor_block_bytes=streamed.spec.block_bytes
    ).larger
    budgets = [streamed.device_weight_bytes, larger[0].device_weight_bytes, streamed.spec.total_bytes]
    kept = []
    for budget in budgets:
        o = build(budget)
        checks = runtime_matches_cost(o, budget, quantization, 1)
        assert all(checks.values()), checks
        fp8 = ("--quantization", quantization) if quantization else ()
        argv = ["memory", "--model", tiny_checkpoint, "--dp", "1", "--mode", mode, "--json"]
        assert main([*argv, "--hbm-budget", str(budget), *fp8]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["hbm_budget"]["resident_blocks"] == list(o.resident_blocks)
        rows = {r["item"]: r["value_bytes"] for r in doc["rows"] if r["section"] == "hbm per card"}
        # the header's spec: on CPU offload packs at the resident model's address residues (up to 64 B per tensor)
        tensors = max(len(b.tensors) for b in o.spec.blocks)
        assert 0 <= o.device_weight_bytes - rows["device weights"] <= 2 * 2 * 64 * tensors
        kept.append(len(o.resident_blocks))
    assert kept[0] == 0 and kept[2] == 4 and (quantization or 0 < kept[1] < 4)  # FP8's staging: no room between


def test_the_policy_keeps_what_fits_and_says_what_more_buys():
    """On a PCIe-bound workload a budget buys speed until the pass is compute-bound; each row's device weights fit
    its budget; below the ring of every candidate nothing fits, and the reason names the minimum."""
    model, top = topology_file.model("bench"), topology_file.topology("1xH200")
    work = topology_file.workload("image 1024^2 CFG, 24 steps")
    streamed = plan(model, top, work)
    steps = []
    for budget in (4 * 10**9, 8 * 10**9, 10**11):
        result = plan(model, top, work, hbm_budget=budget)
        assert all(r.hbm_bytes <= budget and r.fits for r in result.rows)
        steps.append(result.chosen.step_s)
        assert [n for n, _ in result.larger_budgets] == sorted(n for n, _ in result.larger_budgets)
        assert all(t <= result.chosen.step_s * (1 + 1e-9) for _, t in result.larger_budgets)
    assert streamed.chosen.step_s > steps[0] > steps[1] == pytest.approx(steps[2])
    assert len(plan(model, top, work, hbm_budget=10**11).chosen.resident) == 24
    starved = plan(model, top, work, hbm_budget=10**9)
    assert not starved.rows and all("pass at least" in r.note for r in starved.dropped)
    with pytest.raises(ValueError, match="no plan of bench fits .*pass at least"):
        starved.chosen
    with pytest.raises(BudgetError):
        resident_plan(model.sizes, 10**9, num_shards=1, mode="rank-local")


def test_cli_budget_mistakes_are_one_line(capsys):
    assert main(["memory", "--model", "tiny", "--dp", "1", "--hbm-budget", "3"]) == 2
    assert main(["memory", "--model-bytes", "10GB", "--dp", "1", "--quantization", "fp8"]) == 2
    assert main(["policy", "--model", "minimax-h3", "--quantization", "fp8"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "pass at least" in err[0] and "Traceback" not in "".join(err)


def test_resident_compute_joins_the_streamed_block_before_it():
    """Golden: blocks 0 and 2 resident of 5; block 0 (before the first streamed block) joins the last, where the
    ring wraps; the pass's compute is kept."""
    from dlo_fn.cost.policy import _fold

    assert _fold((1.0, 2.0, 4.0, 8.0, 16.0), (0, 2)) == (6.0, 8.0, 17.0)
    assert _fold((1.0, 2.0, 4.0), ()) == (1.0, 2.0, 4.0)


@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
def test_the_policys_device_stored_shards_are_what_offload_holds(tiny_checkpoint, mode):
    """FP8 shards on a link-bound machine: the policy spends what its plan leaves of the budget on device-stored
    shards (loaded at the device's copy rate), and ``offload`` placed by the policy's row keeps the same blocks
    resident and the same shards on the device: the row's device weights and pinned bytes are what it holds."""
    from dlo_fn.runtime.budget import Placement

    ctx = init_distributed()

    def build(**kw):
        return offload(load_reference(tiny_checkpoint), BLOCK_PATHS, ctx, mode=mode, quantization="fp8", **kw)

    streamed = build()
    sizes = ModelSizes.from_spec(streamed.spec, quantization="fp8")
    top = dataclasses.replace(topology_file.topology("1xH200"), h2d_bytes_per_s=1e3)
    model = PolicyModel(sizes, 64, tensor_block_bytes=streamed.spec.block_bytes)
    cand = Candidate(1, 1, mode, "mesh" if mode == "allgather" else "-", 2, 1, 0)
    work = topology_file.workload("image 1024^2 CFG, 24 steps")
    budget = streamed.device_weight_bytes + max(sizes.shard_bytes(1))  # the ring and room for one shard, not a block
    row = predict(model, top, work, cand, hbm_budget=budget)
    without = dataclasses.replace(top, d2d_copy_bytes_per_s=top.h2d_bytes_per_s)  # a device no faster than the link
    assert row.step_s < predict(model, without, work, cand, hbm_budget=budget).step_s
    o = build(hbm_budget=budget, placement=Placement.from_policy(row.placed_by))
    assert o.budget.device_stored and o.resident_blocks == row.resident
    assert row.hbm_bytes == o.device_weight_bytes <= budget
    assert row.host_bytes - top.framework_host_bytes == o.store.arena_bytes
