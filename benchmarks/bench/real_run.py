"""One model of `bench real`: its checkpoint and resident reference, then every variant in order, each recorded (or
skipped with its reason) and written before the next starts."""

from __future__ import annotations

import pathlib
import time
import traceback
from typing import Callable

import torch

from benchmarks.bench import real_lora as rl
from benchmarks.bench import real_models as rm
from benchmarks.bench import real_ready as rr
from benchmarks.bench import real_variants as rv

__all__ = ["ModelRun"]

REF_FILE = "bench_real_ref.pt"  # inputs and resident output, for the rank processes


class ModelRun:
    def __init__(
        self, ctx, case: rm.ModelCase, folder: pathlib.Path, args, deadline: float | None, write: Callable[[dict], None]
    ) -> None:
        self.ctx, self.case, self.folder, self.args = ctx, case, folder, args
        self.deadline, self._write = deadline, write
        self.platform = ctx.platform
        config, workload = case.at(args.quick)
        self.entry: dict = {
            "name": case.name,
            "class": case.cls,
            "config": config,
            "source": case.source,
            "workload": workload,
            "tokens_per_row": rm.tokens_per_row(case, args.quick),
            "h2d_peaks_bytes_per_s": {},
            "variants": [],
        }
        self.want = self.want_fp8 = None
        self.adapters: tuple[str, ...] = ()  # LoRA files (real_lora) when a variant loads them
        self.want_lora = self.want_fp8_lora = None
        self.want_host = None  # the resident output on the host: every row's error is measured against it

    def write(self) -> None:
        self._write(self.entry)

    @property
    def files(self) -> list[pathlib.Path]:
        return rm.checkpoint_files(self.folder)

    def run(self, variants: list[str]) -> None:
        est = self.prepare_estimate()
        if self.deadline is not None and time.perf_counter() + est > self.deadline:
            self.entry["skipped"] = f"budget: its checkpoint and resident run need ~{est:.0f} s"
            return
        self.prepare(variants)
        for v in variants:
            self.one(v)

    def prepare_estimate(self) -> float:
        """Seconds to write the checkpoint (~1 GB/s) or read a complete one back, and run resident."""
        import diffusers

        from dlo_fn.io.diffusers_load import _meta_build

        config, _ = self.case.at(self.args.quick)
        meta = _meta_build(getattr(diffusers, self.case.cls), config, torch.bfloat16)
        nbytes = sum(p.numel() * p.element_size() for p in meta.parameters())
        reuse = rm.checkpoint_ready(self.folder, self.case, self.args.quick, seed=0)
        return 10 + nbytes / (3e9 if reuse else 1e9)

    # -- the checkpoint and the resident reference ------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, variants: list[str]) -> None:
        from dlo_fn.io.diffusers_load import block_paths_for
        from dlo_fn.io.load import load_model
        from dlo_fn.plan.layout import model_layout
        from dlo_fn.plan.spec import spec_from_module

        args, case, device = self.args, self.case, self.platform.device
        self.inputs = rm.forward_inputs(case, args.quick, device)
        t0 = time.perf_counter()
        if rm.checkpoint_ready(self.folder, case, args.quick, seed=0):
            model = load_model(self.folder, progress=False).to(device)
            ckpt = {"reused": True, "resident_load_s": time.perf_counter() - t0}
        else:
            model = rm.build_random(case, device, args.quick, seed=0)
            ckpt = {
                "reused": False,
                "build_s": time.perf_counter() - t0,
                **rm.write_checkpoint(model, self.folder, case, args.quick, seed=0),
            }
        files = self.files
        ckpt.update(folder=str(self.folder), files=len(files), bytes=sum(f.stat().st_size for f in files))
        spec = spec_from_module(model, block_paths_for(model), name=case.cls)
        self.arena_bytes = model_layout(spec, 1).shard_bytes_per_rank
        self.entry.update(
            checkpoint=ckpt,
            num_blocks=spec.num_blocks,
            block_bytes=spec.total_block_bytes,
            max_block_bytes=max(b.nbytes for b in spec.blocks),
            arena_bytes=self.arena_bytes,
            model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        )
        self.write()
        weights = self.platform.memory_allocated()
        row = rv.measure(
            self.platform,
            lambda: ((lambda: model(**self.inputs)[0]), {"model": model}, lambda: None),  # noqa: F821 (a closure; the name is deleted after its last call)
            want=None,
            warmup=args.warmup,
            repeats=args.repeats,
            base_device_bytes=0,
            profile=self._profiler("resident"),
        )
        row.update(ready_s=None, weight_device_bytes=weights, wall_s=time.perf_counter() - t0)
        self.want = row.pop("output").clone()
        self.want_host = self.want.cpu()
        row.update(rv.error_to_resident(self.want_host, self.want_host))
        self._add("resident", row)
        if any(v in rl.VARIANTS for v in variants):
            self.adapters = rl.write_adapters(model, self.folder, case.family, args.quick)
            rl.load(model, self.adapters[0], rl.NAMES[0])
            row = rv.measure(
                self.platform,
                lambda: ((lambda: model(**self.inputs)[0]), {}, lambda: None),  # noqa: F821 (as above)
                want=None,
                warmup=args.warmup,
                repeats=args.repeats,
                base_device_bytes=0,
            )
            self.want_lora = row.pop("output").clone()
            self._add("resident-lora", {**row, "ready_s": None, "adapter_rank": int(rl.open_rank(self.adapters[0]))})
            model.unload_lora()
        if any(rv.OURS.get(v, {}).get("quantization") for v in variants):
            from dlo_fn.runtime.quant import fake_quantize

            fake_quantize(model)  # in place: the resident model is done with
            self.want_fp8 = model(**self.inputs)[0].clone()
            if any(v in rl.VARIANTS and rv.OURS[v].get("quantization") for v in variants):
                rl.load(model, self.adapters[0], rl.NAMES[0])
                self.want_fp8_lora = model(**self.inputs)[0].clone()
        if any(v.startswith("ranks-") for v in variants):
            cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in self.inputs.items()}
            torch.save({"inputs": cpu, "want": self.want.cpu()}, self.folder / REF_FILE)
        del model
        rv.release(self.platform)
        if self.platform.kind == "cuda":  # a first peak, so every row has a bound even if the floor is skipped
            from dlo_fn.runtime.host_store import alloc_host

            buf, _, fin = alloc_host(1 << 30, self.platform)
            self.entry["h2d_peaks_bytes_per_s"]["registered_1GiB"] = rr.h2d_peak_bytes_per_s(self.platform, buf)
            fin()
            del buf
        self.write()

    # -- one variant ------------------------------------------------------------------------------------------
    def one(self, variant: str) -> None:
        est = self.estimate(variant)
        if self.deadline is not None and time.perf_counter() + est > self.deadline:
            left = self.deadline - time.perf_counter()
            self._skip(variant, f"budget: needs ~{est:.0f} s, {max(left, 0):.0f} s left")
            return
        t0 = time.perf_counter()
        try:
            row = self._run(variant)
            row["wall_s"] = time.perf_counter() - t0  # all of it, set-up to teardown: what a budget must allow
        except Skip as exc:
            self._skip(variant, str(exc))
            return
        except (torch.OutOfMemoryError, MemoryError) as exc:
            rv.release(self.platform)
            self._skip(variant, f"does not fit: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            return
        except Exception as exc:  # recorded, and the run goes on to the next variant
            rv.release(self.platform)
            self._add(
                variant,
                {
                    "status": "error",
                    "reason": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=8),
                },
            )
            return
        out = row.pop("output", None)
        if out is not None:
            row.update(rv.error_to_resident(out, self.want_host))
        self._add(variant, row)

    def _quantized_folder(self) -> str:
        """The model's checkpoint as `python -m dlo_fn quantize` writes it, beside the model's folder (once)."""
        out = self.folder.with_name(self.folder.name + rv.QUANTIZED_SUFFIX)
        if "quantized_checkpoint" not in self.entry:
            from dlo_fn.runtime.quantize import quantize_checkpoint

            t0 = time.perf_counter()
            report = quantize_checkpoint(self.folder, out, overwrite=True, progress=False)
            self.entry["quantized_checkpoint"] = {
                "folder": str(out),
                "quantize_s": time.perf_counter() - t0,
                "tensors": report.num_quantized,
                "source_bytes": report.source_bytes,
                "written_bytes": report.written_bytes,
                "command": f"python -m dlo_fn quantize {self.folder} {out}",
            }
            self.write()
        return str(out)

    def _add(self, variant: str, row: dict) -> None:
        self.entry["variants"].append({"variant": variant, **row})
        self.write()

    def _skip(self, variant: str, reason: str) -> None:
        self._add(variant, {"status": "skipped", "reason": reason})

    def _profiler(self, variant: str):
        """With ``--block-spans``: the row's per-block spans and the host's lead, unprofiled; with ``--profile
        DIR``: one forward profiled, its trace kept in DIR (CUDA only; benchmarks.bench.trace)."""
        spans, keep = getattr(self.args, "block_spans", False), getattr(self.args, "profile", None)
        if not spans and not keep:
            return None
        from benchmarks.bench.trace import block_spans, profile_forward

        def profile(forward, model) -> dict | None:
            out = {}
            if spans and model is not None:
                out["spans"] = block_spans(self.platform, model, forward)
            if keep:
                out["trace"] = profile_forward(self.platform, forward, f"{self.case.name}-{variant}", keep)
            return out

        return profile

    def _run(self, variant: str) -> dict:
        args, p, folder = self.args, self.platform, str(self.folder)
        if variant in rv.OURS:
            kwargs = rv.OURS[variant]
            missing = rv.options_missing(kwargs)
            if missing:
                raise Skip(f"OffloadOptions has no field {', '.join(missing)} yet")
            want = self.want_fp8 if kwargs.get("quantization") else self.want  # the resident run made both
            if variant in rl.VARIANTS:
                want = self.want_fp8_lora if kwargs.get("quantization") else self.want_lora
            first = "floor" not in self.entry  # the floor and the arena's peak, next to the first of ours
            if first:
                self.entry["floor"] = rr.measure_floor(p, self.arena_bytes, self.files)
                self.entry["h2d_peaks_bytes_per_s"]["floor_buffer"] = self.entry["floor"]["h2d_peak_bytes_per_s"]
                self.write()
            warmup = max(args.warmup, rv.GRAPH_WARMUP) if kwargs.get("graph") else args.warmup
            if variant in rv.PREQUANTIZED:
                folder = self._quantized_folder()
            row = rv.measure(
                p,
                rv.ours_setup(
                    self.ctx,
                    folder,
                    kwargs,
                    self.inputs,
                    probe_peak=first,
                    adapters=self.adapters if variant in rl.VARIANTS else (),
                    adapter_counts=(warmup, args.repeats, variant),
                ),
                want=want,
                warmup=warmup,
                repeats=args.repeats,
                profile=self._profiler(variant),
            )
            if row.get("arena_h2d_peak_bytes_per_s"):
                self.entry["h2d_peaks_bytes_per_s"]["arena"] = row["arena_h2d_peak_bytes_per_s"]
            return row
        if variant in ("diffusers-block", "diffusers-leaf"):
            self._needs("accelerate")
            kind = "block_level" if variant == "diffusers-block" else "leaf_level"
            return rv.measure(
                p,
                rv.diffusers_setup(p, folder, self.case.cls, kind, self.inputs),
                want=self.want,
                warmup=args.warmup,
                repeats=args.repeats,
            )
        if variant in rv.ACCELERATE:
            self._needs("accelerate")
            return rv.measure(
                p,
                rv.device_map_setup(p, folder, self.case.cls, rv.ACCELERATE[variant], self.inputs),
                want=self.want,
                warmup=args.warmup,
                repeats=args.repeats,
                profile=self._profiler(variant),
            )
        if variant == "model-offload":
            self._needs("accelerate")
            if p.kind == "cuda":
                free = torch.cuda.mem_get_info()[0]
                if free < 1.15 * self.entry["model_bytes"]:
                    raise Skip(
                        f"the whole model ({self.entry['model_bytes']} bytes) does not fit in the "
                        f"{free} bytes free on the device"
                    )
            return rv.measure(
                p,
                rv.model_offload_setup(p, folder, self.case.cls, self.inputs),
                want=self.want,
                warmup=args.warmup,
                repeats=args.repeats,
            )
        if variant == "ours-cold":
            files = self.files
            rv.release(p)  # earlier variants' models (cycles through their hooks) must let go of the mappings
            rr.evict(files)
            evicted = rr.resident_fraction(files)
            row = rv.measure(
                p,
                rv.ours_setup(self.ctx, folder, rv.OURS["ours-rank-local"], self.inputs),
                want=None,
                warmup=0,
                repeats=0,
            )
            row.update(resident_fraction_after_evict=evicted, evicted=evicted < 0.01, first_read=rr.cold_read_s(files))
            return row
        if variant.startswith("ranks-"):
            return self._ranks(int(variant.split("-")[1]))
        if variant == "pipeline":
            if self.case.family != "flux":
                raise Skip("the pipeline request is Flux's (--models flux)")
            self._needs("transformers", "tokenizers")
            from benchmarks.bench.real_pipeline import run_pipeline

            return {"status": "ok", **run_pipeline(self.ctx, folder, args.quick, args.pipeline_repeats)}
        raise ValueError(f"unknown variant {variant!r}")

    def _ranks(self, world: int) -> dict:
        import os

        from benchmarks.bench.real_ranks import READY_FROM, rank_ready
        from dlo_fn.serve.ranks import run_ranks

        cpus = len(os.sched_getaffinity(0))
        timeout = max(300.0, 4 * self.estimate(f"ranks-{world}"))
        ranks = run_ranks(
            rank_ready,
            world,
            str(self.folder),
            self.platform.kind,
            str(self.folder / REF_FILE),
            time.time(),
            timeout_s=timeout,
            platform="cpu",
            threads_per_rank=max(1, cpus // world),
        )
        return {
            "status": "ok",
            "world_size": world,
            "ranks": ranks,
            "equal_to_resident": all(r["equal_to_resident"] for r in ranks),
            # the ranks' outputs stay in their processes: byte-identical is an error of 0.0, else unknown here
            "rel_error_to_resident": 0.0 if all(r["equal_to_resident"] for r in ranks) else None,
            "ready_s": max(r["ready_s"] for r in ranks),
            "ready_from": READY_FROM,
            "ready_over_floor": max(r["ready_over_floor"] for r in ranks),
            "pinned_bytes_per_rank": [r["pinned_bytes"] for r in ranks],
            "phases_s": _slowest_phases(ranks),
            "note": "W ranks share one device over gloo: memory and time to ready, no forward timing",
        }

    @staticmethod
    def _needs(*modules: str) -> None:
        import importlib.util

        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise Skip(f"needs the {', '.join(missing)} package(s)")

    def estimate(self, variant: str) -> float:
        """Seconds ``variant`` should take here (rough: the set-up at a few GB/s, forwards at the bound; each
        row's ``wall_s`` says what it took)."""
        a, e = self.args, self.entry
        m = e.get("block_bytes", 0)
        peaks = [x for x in e["h2d_peaks_bytes_per_s"].values() if x] or [50e9]
        r = next((v.get("forward_s") for v in e["variants"] if v["variant"] == "resident"), 0.0) or 0.0
        b, n = max(r, m / max(peaks)), a.warmup + a.repeats
        if variant.startswith("ours-"):
            first = 0.0 if "floor" in e else m / 1.2e9  # the floor: five passes over the arena's bytes
            warm = rv.GRAPH_WARMUP if "bgraph" in variant else a.warmup
            quantize = m / 0.5e9 if variant in rv.PREQUANTIZED and "quantized_checkpoint" not in e else 0.0
            return {"ours-cold": 5 + 3 * m / 2e9}.get(
                variant, 3 + m / 2.5e9 + first + quantize + (warm + a.repeats) * 1.05 * b
            )
        return {
            "diffusers-block": 5 + m / 1e9 + n * 1.6 * b,
            "diffusers-leaf": 5 + m / 1e9 + n * 2.5 * b,
            "model-offload": 5 + m / 2e9 + n * (r + 2 * m / 5e9),
            **{v: 5 + m / 2e9 + n * (r + m / 20e9) for v in rv.ACCELERATE},
            "ranks-2": 30 + 2 * m / 2e9,
            "ranks-4": 40 + 2 * m / 2e9,
            "pipeline": 30 + m / 1e9 + (1 + a.pipeline_repeats) * 28 * (r + 1.5 * b),
        }.get(variant, 0.0)


def _slowest_phases(ranks: list[dict]) -> dict:
    """Each phase of a ``ranks-W`` row, the slowest rank's (rank_ready's docstring names them)."""
    out = {
        k: max(r[k] or 0.0 for r in ranks) for k in ("start_s", "import_s", "load_s", "offload_s", "first_forward_s")
    }
    out.update({f"offload.{k}": max(r["offload"][k] for r in ranks) for k in ranks[0]["offload"]})
    out.update({f"store.{k}": max(r["store"][k] for r in ranks) for k in ("copy_s", "pin_s", "threads")})
    return out


class Skip(Exception):
    """A variant that cannot run here, with the one-line reason recorded."""
