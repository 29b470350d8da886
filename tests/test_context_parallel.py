"""diffusers' own context parallelism (Ulysses, ``ContextParallelConfig``) composed with offload, on 2 real gloo
ranks (sp 2): a tiny Wan gives the single process's bits under context parallelism alone and offloaded
(allgather, weights sharded over both ranks); for a tiny Flux, offloaded equals context parallelism alone bit
for bit (context parallelism itself is not bit-exact for it in fp32 on CPU: measured, see
:mod:`dlo_fn.runtime.context_parallel`). Calling it after offload, or without an sp axis, is one clear error."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow


@torch.no_grad()
def _rank(ctx) -> dict:
    from test_third_party import CASES

    from dlo_fn.runtime.context_parallel import enable_context_parallel
    from dlo_fn.runtime.mesh import build_mesh
    from dlo_fn.runtime.offload import offload

    mesh = build_mesh(ctx, sp=2)
    out: dict = {}
    for name, (build, inputs, paths) in CASES.items():
        ref = [build()(**inputs(s))[0] for s in range(2)]
        cp_model = build()
        enable_context_parallel(cp_model, ctx, mesh)
        cp = [cp_model(**inputs(s))[0] for s in range(2)]
        model = build()
        enable_context_parallel(model, ctx, mesh)
        off = offload(model, paths, ctx, mode="allgather", mesh=mesh)
        got = [model(**inputs(s))[0] for s in range(2)]
        out[name] = {
            "cp_equals_single": all(torch.equal(a, b) for a, b in zip(cp, ref)),
            "offloaded_equals_cp": all(torch.equal(a, b) for a, b in zip(got, cp)),
            "offloaded_equals_single": all(torch.equal(a, b) for a, b in zip(got, ref)),
            "num_shards": off.layout.num_shards,
        }
        try:
            enable_context_parallel(model, ctx, mesh)
            out[name]["after_offload"] = None
        except ValueError as exc:
            out[name]["after_offload"] = str(exc)
    return out


@pytest.mark.timeout(600)
def test_offload_composes_with_diffusers_context_parallel(request):
    from conftest import scenario

    results = scenario(request, 2, "context_parallel")  # the shared spawn of 2 ranks (conftest.SCENARIOS)
    for res in results:
        assert res["wan"]["cp_equals_single"] and res["wan"]["offloaded_equals_single"]
        for name in ("wan", "flux"):
            assert res[name]["offloaded_equals_cp"] and res[name]["num_shards"] == 2, name
            assert res[name]["after_offload"] == (
                "enable_context_parallel: call it before offload(): the offloaded blocks' attention processors "
                "are no longer in the module tree"
            )


def test_context_parallel_needs_an_sp_axis_and_a_plan():
    from torch import nn

    from dlo_fn.runtime.context_parallel import enable_context_parallel
    from dlo_fn.runtime.dist import DistContext
    from dlo_fn.runtime.mesh import build_mesh
    from dlo_fn.runtime.platform import platform_for

    ctx = DistContext(0, 1, 0, platform_for("cpu"), None)
    with pytest.raises(ValueError, match="the mesh has sp 1; context parallelism needs sp >= 2"):
        enable_context_parallel(nn.Linear(2, 2), ctx, build_mesh(ctx))
