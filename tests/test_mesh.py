"""The (dp, sp) mesh on real gloo ranks: shapes (1, 2), (2, 1) on 2 ranks and (1, 4), (2, 2), (4, 1) on 4, each
rank's coordinates and the members of its dp and sp groups; on the (2, 2) mesh the two replicas each run their
own request with sp 2 and get the single-process bits; sizes that do not fit the world give one clear line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import scenario

from dlo_fn.models.sp import sp_of
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.mesh import build_mesh
from dlo_fn.runtime.platform import platform_for

SHAPES = {2: ((1, 2), (2, 1)), 4: ((1, 4), (2, 2), (4, 1))}


def _request(dp_rank: int):
    from dlo_fn.models import Request

    return Request(
        prompt=f"a lantern, replica {dp_rank}",
        seed=dp_rank,
        height=48,
        width=48,
        num_frames=1,
        num_inference_steps=2,
        guidance_scale=3.0,
    )  # 9 tokens: padded to 10 at sp 2


def _errors(ctx: DistContext) -> list[str]:
    out = []
    for kwargs in ({"sp": 3}, {"sp": 2, "dp": 1}, {"sp": 0}):
        try:
            build_mesh(ctx, **kwargs)
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


@torch.no_grad()
def _rank(ctx: DistContext) -> dict:
    out: dict = {"errors": _errors(ctx)}  # before any group is created: no rank may hang on a bad size
    for dp, sp in SHAPES[ctx.world_size]:
        mesh = build_mesh(ctx, sp=sp)  # dp = world / sp
        out[(dp, sp)] = {
            "names": mesh.device_mesh.mesh_dim_names,
            "shape": (mesh.dp_size, mesh.sp_size),
            "coordinate": mesh.coordinate,
            "dp_members": tuple(dist.get_process_group_ranks(mesh.dp_group)),
            "sp_members": tuple(dist.get_process_group_ranks(mesh.sp_group)),
            "sp_is_none": sp_of(mesh) is None,
        }
        if (dp, sp) == (2, 2):
            from dlo_fn.models import CONFIGS, build_model, generate

            model = build_model(CONFIGS["tiny"], "cpu", torch.float32)
            req = _request(mesh.dp_rank)
            got, ref = generate(model, req, sp=sp_of(mesh)), generate(model, req)
            out["sp_in_mesh"] = (torch.equal(got.latents, ref.latents), got.sha256, ref.sha256)
    return out


@pytest.fixture(params=[2, 4], ids=["world2", "world4"])
def ranks(request):
    """Every rank's results of :func:`_rank` (the shared spawn of this world size, conftest.SCENARIOS)."""
    return request.param, scenario(request, request.param, "mesh")


@pytest.mark.timeout(600)
def test_coordinates_and_group_members(ranks):
    world, results = ranks
    for dp, sp in SHAPES[world]:
        for rank, res in enumerate(results):
            got = res[(dp, sp)]
            dp_rank, sp_rank = divmod(rank, sp)  # torch's row-major layout: sp partners are consecutive ranks
            assert got["names"] == ("dp", "sp") and got["shape"] == (dp, sp)
            assert got["coordinate"] == (dp_rank, sp_rank), (dp, sp, rank)
            assert got["sp_members"] == tuple(range(dp_rank * sp, dp_rank * sp + sp)), (dp, sp, rank)
            assert got["dp_members"] == tuple(range(sp_rank, world, sp)), (dp, sp, rank)
            assert got["sp_is_none"] == (sp == 1)


@pytest.mark.timeout(600)
def test_sp_replicas_in_a_2x2_mesh_match_the_single_process(request):
    shas = []
    for res in scenario(request, 4, "mesh"):
        equal, got, ref = res["sp_in_mesh"]
        assert equal and got == ref
        shas.append(got)
    assert shas[0] == shas[1] != shas[2] == shas[3]  # sp partners agree; the two replicas ran different requests


@pytest.mark.timeout(600)
def test_sizes_that_do_not_fit_are_one_clear_line(ranks):
    world, results = ranks
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    expected = [
        f"sp=3 does not divide the world size {world}: use sp in {divisors} (dp = world / sp)",
        f"dp=1 x sp=2 = 2 ranks, but the world has {world}: use dp = {world // 2}",
        "sp=0: must be a positive int",
    ]
    if world == 2:
        expected[1] = "no error"
    for res in results:
        assert res["errors"] == expected


def test_single_process_mesh_has_no_groups():
    ctx = DistContext(0, 1, 0, platform_for("cpu"), None)
    mesh = build_mesh(ctx)
    assert (mesh.dp_size, mesh.sp_size, mesh.coordinate, sp_of(mesh), mesh.device_mesh) == (1, 1, (0, 0), None, None)
    with pytest.raises(ValueError, match="sp=2 does not divide the world size 1"):
        build_mesh(ctx, sp=2)
