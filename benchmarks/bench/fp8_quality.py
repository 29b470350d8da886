"""`python -m benchmarks bench fp8-quality`: what FP8 shards cost in output quality on the reference DiT, measured.

The reference DiT's checkpoint (BF16 linears, FP32 norms; ``--config``, random weights from ``--seed``) runs three
ways on one device: resident in BF16 (the reference), resident with :func:`~dlo_fn.runtime.quant.fake_quantize`
(the FP8 reference) and offloaded with ``quantization="fp8"``. Per output, the offloaded FP8 output against the
BF16 one (:func:`output_error`: relative L2, max-abs, cosine, in float64 on the host), and
whether it equals the fake-quantised model's bit for bit:

    weights           every block weight stored as FP8, dequantised, against its BF16 value (the input error)
    one forward       the velocity of the request's first denoising step (CFG pair, one batch)
    request latents   the final latents after every denoising step of ``generate``
    request video     the decoded uint8 video of the same request

``figures/data/fp8_quality_<config>_<machine>.json``: the rows, the request and the machine, command and date.
The real-size models' error (Flux, Wan) is the ``rel_error_to_resident`` of ``bench real``'s ``ours-fp8`` row.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import tempfile
from dataclasses import dataclass

from dlo_fn.cli import HelpFormatter

__all__ = ["QualityRow", "output_error", "REQUEST", "reference_dit_quality", "register", "run"]

# The request measured (notebooks 03 and 11's shape, four steps: a whole sampling schedule from noise to latents).
REQUEST = dict(prompt="a red fox in the snow", seed=0, height=32, width=32, num_frames=5, num_inference_steps=4)


@dataclass(frozen=True, slots=True)
class QualityRow:
    """How far an ``output`` ``y`` is from its reference ``r`` (:func:`output_error`), over every element::

        rel_l2  = ||y - r||_2 / ||r||_2          max_abs = max |y - r|          cosine = <y, r> / (||y|| ||r||)

    ``equal_to_fake_quantized``: whether ``y`` equals the fake-quantised model's output bit for bit (None: not
    compared, as for the weights)."""

    output: str
    rel_l2: float
    max_abs: float
    cosine: float
    num_elements: int
    equal_to_fake_quantized: bool | None = None


def output_error(got, want, output: str = "", fake=None) -> QualityRow:
    """:class:`QualityRow` of ``got`` against ``want`` (same shape), computed on the host in float64, so the
    measure adds next to no rounding of its own: equal outputs give exactly ``rel_l2 = max_abs = 0.0`` and
    ``cosine = 1.0`` (two zero tensors too); a zero ``want`` with a non-zero ``got`` has ``rel_l2`` inf and
    ``cosine`` 0. ``fake``: the fake-quantised model's output, compared bit for bit."""
    import torch

    if got.shape != want.shape:
        raise ValueError(f"output_error: shapes differ, {tuple(got.shape)} against {tuple(want.shape)}")
    y, r = (t.detach().to("cpu", torch.float64).reshape(-1) for t in (got, want))
    diff, ref = (y - r).norm().item(), r.norm().item()
    norms = y.norm().item() * ref
    return QualityRow(
        output,
        rel_l2=diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf")),
        max_abs=(y - r).abs().max().item() if y.numel() else 0.0,
        cosine=1.0 if diff == 0 else max(-1.0, min(1.0, (y @ r).item() / norms)) if norms > 0 else 0.0,
        num_elements=y.numel(),
        equal_to_fake_quantized=None if fake is None else bool(torch.equal(got, fake)),
    )


def _quantized_weights(model, block_paths):
    """Every block weight ``fake_quantize`` rewrites, flattened into one float64 vector, in block order."""
    import torch

    from dlo_fn.plan.quant import quantized_tensors
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.quant import fp32_modules

    names = quantized_tensors(spec_from_module(model, block_paths), fp32_modules(model))
    weights = [model.get_parameter(k) if t.kind == "param" else model.get_buffer(k) for k, t in names.items()]
    return torch.cat([w.detach().to("cpu", torch.float64).reshape(-1) for w in weights])


def _forward_and_request(model, request):
    """The first step's velocity and the whole request's result (:func:`dlo_fn.models.generate`)."""
    import torch

    from dlo_fn.models import generate, init_state, model_inputs

    with torch.no_grad():
        state = init_state(model, request)
        velocity = model(*model_inputs(state), model.encode_text(state.text_tokens)).clone()
    return velocity, generate(model, request)


def reference_dit_quality(
    checkpoint: str | pathlib.Path, ctx, request=None, mode: str = "rank-local"
) -> tuple[QualityRow, ...]:
    """The rows of the module doc for the reference DiT in ``checkpoint`` on ``ctx``'s device: offloaded FP8
    (``mode``) against resident BF16, and against the fake-quantised resident model bit for bit."""
    from dlo_fn.io.load import load_model
    from dlo_fn.models import BLOCK_PATHS, Request
    from dlo_fn.runtime.offload import offload
    from dlo_fn.runtime.quant import fake_quantize

    request = request or Request(**REQUEST)
    device = ctx.platform.device
    resident = load_model(checkpoint).to(device)
    weights_bf16 = _quantized_weights(resident, BLOCK_PATHS)
    forward_bf16, result_bf16 = _forward_and_request(resident, request)
    del resident
    fake = fake_quantize(load_model(checkpoint).to(device), BLOCK_PATHS)
    weights_fp8 = _quantized_weights(fake, BLOCK_PATHS)
    forward_fake, result_fake = _forward_and_request(fake, request)
    del fake
    o = offload(load_model(checkpoint), BLOCK_PATHS, ctx, mode=mode, quantization="fp8")
    try:
        forward_fp8, result_fp8 = _forward_and_request(o.model, request)
    finally:
        o.synchronize()
        o.store.close()
    return (
        output_error(weights_fp8, weights_bf16, "weights"),
        output_error(forward_fp8, forward_bf16, "one forward", forward_fake),
        output_error(result_fp8.latents, result_bf16.latents, "request latents", result_fake.latents),
        output_error(result_fp8.video, result_bf16.video, "request video", result_fake.video),
    )


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fp8-quality",
        help="FP8 shards against BF16: output error on the reference DiT",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", default="tiny", help="reference DiT config (dlo_fn.models.CONFIGS)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed")
    p.add_argument("--mode", choices=("rank-local", "allgather"), default="rank-local")
    p.add_argument("--steps", type=int, default=REQUEST["num_inference_steps"], help="denoising steps")
    p.add_argument("--platform", choices=("cuda", "cpu"), default=None, help="default: detect")
    p.add_argument("--out", default=None, help="JSON path (default figures/data/fp8_quality_<config>_<machine>.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from benchmarks.bench.report import stamp
    from benchmarks.bench.step import slug
    from benchmarks.repro.data import DATA_DIR
    from dlo_fn.models import Request
    from dlo_fn.models.checkpoint import ensure_checkpoint
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import detect_platform

    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform)
    request = Request(**dict(REQUEST, num_inference_steps=args.steps))
    with tempfile.TemporaryDirectory(prefix="dlo_fn_fp8q_") as tmp:
        ckpt = ensure_checkpoint(tmp, args.config, seed=args.seed)
        rows = reference_dit_quality(ckpt, ctx, request, args.mode)
    argv = [
        "bench",
        "fp8-quality",
        "--config",
        args.config,
        "--seed",
        str(args.seed),
        "--mode",
        args.mode,
        "--steps",
        str(args.steps),
    ] + (["--platform", args.platform] if args.platform else [])
    report = stamp(
        {
            "config": args.config,
            "seed": args.seed,
            "mode": args.mode,
            "checkpoint_dtype": "bf16",
            "request": dataclasses.asdict(request),
            "rows": [dataclasses.asdict(r) for r in rows],
        },
        "benchmarks",
        argv,
        platform,
    )
    path = pathlib.Path(args.out) if args.out else DATA_DIR / f"fp8_quality_{args.config}_{slug(platform)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
    from benchmarks.repro.fp8_tables import quality_rows
    from benchmarks.repro.tables import text_table

    print(text_table(quality_rows(report["rows"])))
    print(f"bench fp8-quality: -> {path}")
    return 0
