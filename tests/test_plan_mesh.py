"""The (dp, sp) mesh plan: golden rank tables and shard groups, properties over generated meshes and models, the
SP activation model's phases, and agreement with the models' TokenShard and the layout digest."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo_fn.cost.mesh import SHARD_GROUPS, MeshPlan, rank_shard_ranges
from dlo_fn.cost.sp_memory import BlockDims, sp_activations
from dlo_fn.plan.layout import align_up, model_layout
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.spec import BlockSpec, ModelSpec, TensorSpec


def _table(mesh: MeshPlan, tokens: int = 10, heads: int = 4) -> list[str]:
    sizes = ModelSizes("m", (1000, 3000), 0)
    return [
        f"{r.rank} ({r.dp_rank},{r.sp_rank}) t[{r.token_range[0]},{r.token_range[1]})+{r.pad_tokens} "
        f"h[{r.head_range[0]},{r.head_range[1]}) g{list(r.shard_group)} i{r.shard_index}/{r.num_shards} "
        f"p{r.pinned_bytes}"
        for r in mesh.rank_table(sizes, tokens, heads)
    ]


def test_golden_rank_tables_dp2_sp2():
    assert _table(MeshPlan(2, 2)) == [
        "0 (0,0) t[0,5)+0 h[0,2) g[0, 1, 2, 3] i0/4 p1024",
        "1 (0,1) t[5,10)+0 h[2,4) g[0, 1, 2, 3] i1/4 p1024",
        "2 (1,0) t[0,5)+0 h[0,2) g[0, 1, 2, 3] i2/4 p1024",
        "3 (1,1) t[5,10)+0 h[2,4) g[0, 1, 2, 3] i3/4 p1024",
    ]
    assert _table(MeshPlan(2, 2, "dp")) == [
        "0 (0,0) t[0,5)+0 h[0,2) g[0, 2] i0/2 p2048",
        "1 (0,1) t[5,10)+0 h[2,4) g[1, 3] i0/2 p2048",
        "2 (1,0) t[0,5)+0 h[0,2) g[0, 2] i1/2 p2048",
        "3 (1,1) t[5,10)+0 h[2,4) g[1, 3] i1/2 p2048",
    ]
    assert _table(MeshPlan(2, 2, "sp")) == [
        "0 (0,0) t[0,5)+0 h[0,2) g[0, 1] i0/2 p2048",
        "1 (0,1) t[5,10)+0 h[2,4) g[0, 1] i1/2 p2048",
        "2 (1,0) t[0,5)+0 h[0,2) g[2, 3] i0/2 p2048",
        "3 (1,1) t[5,10)+0 h[2,4) g[2, 3] i1/2 p2048",
    ]


def test_golden_padding_ranks_dp1_sp4():
    # 9 tokens over 4 ranks: l = 3, the last rank holds pads only.
    assert _table(MeshPlan(1, 4), tokens=9, heads=8) == [
        "0 (0,0) t[0,3)+0 h[0,2) g[0, 1, 2, 3] i0/4 p1024",
        "1 (0,1) t[3,6)+0 h[2,4) g[0, 1, 2, 3] i1/4 p1024",
        "2 (0,2) t[6,9)+0 h[4,6) g[0, 1, 2, 3] i2/4 p1024",
        "3 (0,3) t[9,9)+3 h[6,8) g[0, 1, 2, 3] i3/4 p1024",
    ]


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="dp=0"):
        MeshPlan(0, 2)
    with pytest.raises(ValueError, match="shard_group='node'"):
        MeshPlan(1, 2, "node")
    with pytest.raises(ValueError, match="num_heads 30 is not divisible by sp 4"):
        MeshPlan(1, 4).head_range(0, 30)
    with pytest.raises(ValueError, match="rank 4 outside"):
        MeshPlan(2, 2).coordinate(4)
    spec = ModelSpec("m", (BlockSpec("b.0", (TensorSpec("w", (100,), torch.float32),)),))
    with pytest.raises(ValueError, match="model_layout\\(spec, mesh.num_shards\\)"):
        rank_shard_ranges(MeshPlan(2, 2), model_layout(spec, 2), 0)


meshes = st.builds(MeshPlan, st.integers(1, 4), st.integers(1, 4), st.sampled_from(SHARD_GROUPS))
block_bytes = st.lists(st.integers(1, 5000), min_size=1, max_size=4)


def _spec(sizes: list[int]) -> ModelSpec:
    blocks = (BlockSpec(f"b.{i}", (TensorSpec("w", (n,), torch.uint8),)) for i, n in enumerate(sizes))
    return ModelSpec("m", tuple(blocks))


@settings(max_examples=150, deadline=None)
@given(meshes, block_bytes)
def test_shard_groups_partition_the_mesh_and_cover_every_block(mesh, sizes):
    groups = mesh.shard_groups
    assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))
    assert all(len(g) == mesh.num_shards for g in groups)
    layout = model_layout(_spec(sizes), mesh.num_shards)
    for group in groups:
        # The ranks of one shard group hold disjoint ranges that tile each padded block exactly.
        ranges = [rank_shard_ranges(mesh, layout, r) for r in group]
        for b, shard in enumerate(layout.shards):
            spans = sorted(rr[b] for rr in ranges)
            assert spans[0][0] == 0 and spans[-1][1] == shard.padded_bytes
            assert all(a[1] == c[0] for a, c in zip(spans, spans[1:]))
    for r in range(mesh.world_size):
        assert r in mesh.shard_group_of(r) and mesh.rank_of(*mesh.coordinate(r)) == r


@settings(max_examples=150, deadline=None)
@given(meshes, block_bytes, st.sampled_from((8, 256, 4096)))
def test_pinned_per_rank_is_model_over_w_rounded_up_per_block(mesh, sizes, alignment):
    s = ModelSizes("m", tuple(sizes))
    w = mesh.num_shards
    expected = sum(align_up(-(-n // w), alignment) for n in sizes)
    assert mesh.pinned_bytes_per_rank(s, alignment) == expected
    assert expected >= -(-s.total_block_bytes // w)
    assert expected < s.total_block_bytes / w + len(sizes) * alignment
    if mesh.shard_group == "world":
        assert w == mesh.dp * mesh.sp


@settings(max_examples=100, deadline=None)
@given(meshes, block_bytes)
def test_digest_is_the_same_for_every_rank_and_every_group_of_the_same_size(mesh, sizes):
    spec = _spec(sizes)
    digests = {model_layout(spec, len(mesh.shard_group_of(r))).digest for r in range(mesh.world_size)}
    assert digests == {model_layout(spec, mesh.num_shards).digest}
    other = MeshPlan(mesh.dp, mesh.sp, "world")
    assert (model_layout(spec, other.num_shards).digest == model_layout(spec, mesh.num_shards).digest) == (
        other.num_shards == mesh.num_shards
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 50))
def test_token_ranges_tile_the_sequence_and_agree_with_token_shard(dp, sp, tokens):
    from dlo_fn.models.sp import SPContext, TokenShard

    mesh = MeshPlan(dp, sp)
    for replica in mesh.sp_groups:
        spans = [mesh.token_range(r, tokens) for r in replica]
        assert spans[0][0] == 0 and spans[-1][1] == tokens and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for r in replica:
            shard = TokenShard(SPContext(object() if sp > 1 else None, sp, mesh.coordinate(r)[1]), tokens)
            assert shard.local_tokens == mesh.local_tokens(tokens)
            x = torch.arange(tokens)[None, :, None]
            lo, hi = mesh.token_range(r, tokens)
            assert torch.equal(shard.local(x)[0, : hi - lo, 0], torch.arange(lo, hi))


DIMS = BlockDims(hidden_dim=64, mlp_dim=256, num_heads=4)


def test_sp_activation_phases_golden():
    a = sp_activations(DIMS, tokens=768, sp=2)
    u = 384 * 64
    rotary = 4 * 768 * 16  # the whole cos and sin tables: each rank's rows are views of them
    got = {p.name: (p.activation_bytes - rotary, p.communication_bytes) for p in a.phases}
    assert got == {
        "qk norm + rotary": (28 * u, 0),
        "tokens -> heads": (34 * u, 12 * u),
        "heads -> tokens": (12 * u + 10 * u, 2 * u),
        "cross-attn q norm": (26 * u, 0),
        "mlp": (16 * u + 16 * u, 0),
    }
    assert a.peak_phase.name == "tokens -> heads" and a.peak_bytes == 46 * u + rotary
    single = sp_activations(DIMS, tokens=768, sp=1)
    assert [p.name for p in single.phases] == ["qk norm + rotary", "attention", "cross-attn q norm", "mlp"]
    assert single.peak_phase.name == "mlp"


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5000), st.sampled_from((1, 2, 4)), st.integers(1, 2))
def test_sp_terms_are_linear_in_local_tokens(local, sp, batch):
    dims = BlockDims(64, 256, 4, patch_dim=16, text_len=8, text_dim=32)
    one, two = sp_activations(dims, local * sp, sp, batch), sp_activations(dims, 2 * local * sp, sp, batch)
    assert one.local_tokens == local and [p.name for p in one.phases] == [p.name for p in two.phases]
    for p, q in zip(one.phases, two.phases):
        fixed_p = dict(p.activation_terms)["inputs"] + dict(p.activation_terms)["rotary tables"]
        fixed_q = dict(q.activation_terms)["inputs"] + dict(q.activation_terms)["rotary tables"]
        assert q.total_bytes - fixed_q == 2 * (p.total_bytes - fixed_p)  # every other term is per local token
    assert (one.communication_bytes > 0) == (sp > 1)


def test_sp_rejects_heads_that_do_not_split():
    with pytest.raises(ValueError, match="num_heads 30 is not divisible by sp 4"):
        sp_activations(BlockDims(3840, 15872, 30), 75600, 4)


def _cli_json(capsys, *args) -> dict:
    import json

    from dlo_fn.cli import main

    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_cli_mesh_terms_and_rank_table(capsys):
    from dlo_fn.cost.mesh_memory import mesh_hbm
    from dlo_fn.models import get_config
    from dlo_fn.models.specs import config_spec

    doc = _cli_json(capsys, "plan", "--model", "cosmos3-super", "--dp", "2", "--sp", "4")
    sizes = ModelSizes.from_spec(config_spec("cosmos3-super"))
    mesh = MeshPlan(2, 4)
    assert doc["num_shards"] == doc["mesh"]["num_shards"] == 8
    assert doc["pinned_host_bytes_per_rank"] == mesh.pinned_bytes_per_rank(sizes)
    rows = {r["item"]: r["value_bytes"] for r in doc["mesh"]["rows"]}
    sp = sp_activations(BlockDims.from_config(get_config("cosmos3-super")), 75600, 4)
    assert (rows["activations"], rows["communication"]) == (sp.activation_bytes, sp.communication_bytes)
    assert rows["hbm peak"] == mesh_hbm(sizes, mesh, sp).peak_bytes
    assert rows["slots"] + rows["landing buffers"] == doc["hbm_weight_bytes"]
    assert [(r["rank"], r["tokens"], r["heads"], r["shard_index"]) for r in doc["mesh"]["ranks"][3:5]] == [
        (3, [56700, 75600], [33, 44], 3),
        (4, [0, 18900], [0, 11], 4),
    ]
    dp_group = _cli_json(capsys, "plan", "--model", "cosmos3-super", "--dp", "2", "--sp", "4", "--shard-group", "dp")
    assert (
        dp_group["num_shards"] == 2
        and dp_group["layout_digest"]
        == _cli_json(capsys, "plan", "--model", "cosmos3-super", "--num-shards", "2")["layout_digest"]
    )


def test_memory_cli_mesh_rows(capsys):
    doc = _cli_json(
        capsys,
        "memory",
        "--model",
        "cosmos3-nano",
        "--dp",
        "2",
        "--sp",
        "3",
        "--shard-group",
        "sp",
        "--tokens",
        "75600",
    )
    rows = {(r["section"], r["item"]): r["value_bytes"] for r in doc["rows"]}
    from dlo_fn.models.specs import config_spec

    sizes = ModelSizes.from_spec(config_spec("cosmos3-nano"))
    assert doc["num_shards"] == 3
    assert rows[("host: steady state", "pinned per rank")] == sizes.shard_bytes_per_rank(3)
    assert rows[("host: steady state", "pinned, all ranks")] == 6 * sizes.shard_bytes_per_rank(3)
    assert rows[("mesh: per rank", "communication")] > 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "--model", "cosmos3-nano", "--sp", "4"], "num_heads 30 is not divisible by sp 4"),
        (["plan", "--model", "tiny", "--dp", "0"], "--dp/--sp/--shard-group: dp=0"),
        (["plan", "--model", "tiny", "--sp", "2", "--num-shards", "3"], "leave --num-shards out"),
    ],
)
def test_cli_mesh_errors_are_one_line(args, message, capsys):
    from dlo_fn.cli import main

    assert main(args) == 2  # a usage error, through the CLI's one error boundary
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
