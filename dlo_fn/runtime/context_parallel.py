"""Third-party DiTs under sequence parallelism: diffusers' own context parallelism (Ulysses) composed with offload.

diffusers 0.42.1 splits a model's sequence over ranks itself (``ContextParallelConfig(ulysses_degree=S)``
through ``model.enable_parallelism``): hooks named by the model's ``_cp_plan`` split the hidden states at the
first block and gather them at the output projection, and the attention processors run the all-to-alls. We
do not write Ulysses again for those models; :func:`enable_context_parallel` turns diffusers' on for the sp
axis of a (dp, sp) mesh, and :func:`dlo_fn.runtime.offload.offload` then wraps the blocks as for any model::

    mesh = build_mesh(ctx, sp=2)
    enable_context_parallel(wan, ctx, mesh)          # first: it must reach the attention processors
    offload(wan, "blocks", ctx, mesh=mesh)           # the blocks' weights then live in the shard group

Order matters: offload keeps the original blocks out of the module tree (behind block proxies), so
``enable_parallelism`` afterwards would not find their attention processors; this is checked. The hooks on the
blocks stay on the block modules the executor calls, so they run inside each offloaded block call.

The sequence-parallel group is each replica's sp ranks: the CP mesh is a (dp, ring = 1, ulysses = sp) device
mesh over the same ranks as the (dp, sp) mesh, sliced to (ring, ulysses), which is the 2-D mesh
``ContextParallelConfig`` expects. On a machine with no accelerator ``enable_parallelism`` cannot run: it
picks its device as ``rank % torch.accelerator.device_count()`` (measured with diffusers 0.42.1 on CPU:
``ZeroDivisionError: integer modulo by zero`` in ``ModelMixin._resolve_parallel_config``). There this module
takes the same steps for the context-parallel case that ``enable_parallelism`` takes (build the parallel
config on the CP mesh, hand it to every attention processor, apply the ``_cp_plan`` hooks) with the
platform's device; with an accelerator it calls ``enable_parallelism`` itself.

Bit-exactness: offload composes exactly (the same bits as the model under context parallelism alone, tested on
a tiny Wan and a tiny Flux over 2 gloo ranks). Whether context parallelism itself gives the single process's
bits is diffusers' business: for the tiny Wan it does, for the tiny Flux in fp32 on CPU it does not (max
|diff| ~2e-7: its split rows meet different GEMM and SDPA blockings, the effect :mod:`dlo_fn.models.layers`
pads away for the reference DiT).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dlo_fn.runtime.blocks import BlockProxy
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.mesh import Mesh

__all__ = ["enable_context_parallel"]


def _cp_mesh(ctx: DistContext, mesh: Mesh) -> Any:
    """The (ring = 1, ulysses = sp) device mesh of this rank's replica, over the (dp, sp) mesh's ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    full = init_device_mesh(
        ctx.platform.device.type, (mesh.dp_size, 1, mesh.sp_size), mesh_dim_names=("cp_dp", "ring", "ulysses")
    )
    return full["ring", "ulysses"]


def enable_context_parallel(model: nn.Module, ctx: DistContext, mesh: Mesh, **cp_options: Any) -> Any:
    """Turn on diffusers' Ulysses context parallelism over ``mesh``'s sp axis (module docstring); returns the
    ``ContextParallelConfig``. Every rank must call it (it creates process groups). ``cp_options`` go to
    ``ContextParallelConfig`` (e.g. ``convert_to_fp32``). ``ValueError`` for a model diffusers cannot split or
    one already offloaded."""
    import diffusers

    if mesh.sp_size < 2:
        raise ValueError(f"enable_context_parallel: the mesh has sp {mesh.sp_size}; context parallelism needs sp >= 2")
    if getattr(model, "_cp_plan", None) is None:
        raise ValueError(f"{type(model).__name__} has no _cp_plan: diffusers cannot split its sequence")
    if any(isinstance(m, BlockProxy) for m in model.modules()):
        raise ValueError(
            "enable_context_parallel: call it before offload(): the offloaded blocks' attention "
            "processors are no longer in the module tree"
        )
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads is not None and heads % mesh.sp_size:
        raise ValueError(
            f"num_attention_heads {heads} is not divisible by sp {mesh.sp_size} (Ulysses gives each sp rank heads / sp)"
        )
    cp = diffusers.ContextParallelConfig(ulysses_degree=mesh.sp_size, mesh=_cp_mesh(ctx, mesh), **cp_options)
    if torch.accelerator.device_count() > 0:
        model.enable_parallelism(config=cp)
        return cp
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(f"{type(model).__name__}: parallelism is already applied")
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(ctx.rank, ctx.world_size, ctx.platform.device, mesh=cp.mesh)
    model._parallel_config = config
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if isinstance(module, (Attention, MochiAttention, AttentionModuleMixin)) and hasattr(
            processor, "_parallel_config"
        ):
            processor._parallel_config = config
    apply_context_parallel(model, cp, model._cp_plan)
    return cp
