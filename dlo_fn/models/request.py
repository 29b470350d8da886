"""One generation request, as frozen data, and its validation against a model config.

Fields (all compared by ``==`` and hashable, so wave grouping can key on them):

    field                default        read by the reference sampler
    prompt               (required)     yes: byte tokens of the conditional branch
    seed                 0              yes: CPU torch.Generator for the initial noise
    height, width        480, 832       yes: pixel size (multiples of vae_spatial x patch)
    num_frames           29             yes: 1 + k * vae_temporal (1 = an image)
    fps                  24             no: metadata for writing the video
    num_inference_steps  35             yes: Euler steps
    guidance_scale       5.0            yes: > 1 runs the CFG pair (cond, uncond) as one batch-2 forward; 1 = off
    shift                5.0            yes: timestep shift sigma' = s sigma / (1 + (s - 1) sigma)
    sampler              "flow_euler"   yes: must be in SAMPLERS
    negative_prompt      ""             yes: tokens of the unconditional branch
    outputs_per_prompt   1              yes: N videos from one noise generator, drawn in order
    quality              "default"      no: carried for serving / wave grouping
    lora, lora_scale     None, 1.0      yes: the adapter (dlo_fn.models.lora) active for it, at that scale
    extra_args           {}             no: a read-only dict (FrozenDict) of JSON scalars / tuples, carried as is

Defaults are the published Cosmos3-Nano workload (832 x 480, 29 frames, 35 steps).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from dlo_fn.models.config import DiTConfig, check_known_fields, check_video_shape

__all__ = ["Request", "SAMPLERS", "FrozenDict"]

SAMPLERS = ("flow_euler",)
_SCALARS = (str, int, float, bool, type(None))


class FrozenDict(dict):
    """A read-only, hashable dict: still a ``dict`` for ``json.dumps``, ``==`` and pickling."""

    def _readonly(self, *args, **kwargs):
        raise TypeError("Request.extra_args is read-only: build a new Request with dataclasses.replace")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _readonly

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: str(kv[0]))))

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def _is_json_value(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_is_json_value(v) for v in value)
    return isinstance(value, _SCALARS) and not (isinstance(value, float) and not math.isfinite(value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class Request:
    prompt: str
    seed: int = 0
    height: int = 480
    width: int = 832
    num_frames: int = 29
    fps: float = 24
    num_inference_steps: int = 35
    guidance_scale: float = 5.0
    shift: float = 5.0
    sampler: str = "flow_euler"
    negative_prompt: str = ""
    outputs_per_prompt: int = 1
    quality: str = "default"
    lora: str | None = None
    lora_scale: float = 1.0
    extra_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.extra_args, Mapping):
            raise ValueError(f"extra_args must be a mapping, got {type(self.extra_args).__name__}")
        frozen = {k: _freeze(v) for k, v in sorted(self.extra_args.items(), key=lambda kv: str(kv[0]))}
        object.__setattr__(self, "extra_args", FrozenDict(frozen))

    @property
    def cfg(self) -> bool:
        """Whether each step runs the (cond, uncond) pair."""
        return self.guidance_scale > 1.0

    @property
    def batch_size(self) -> int:
        """Rows of one model forward: outputs_per_prompt, doubled by CFG."""
        return self.outputs_per_prompt * (2 if self.cfg else 1)

    def validate(self, config: DiTConfig | None = None) -> "Request":
        """Raise ``ValueError`` naming the first bad field; with a config, also check the shape and prompt
        lengths against the model. Returns self, so ``Request(...).validate(cfg)`` chains."""
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"prompt={self.prompt!r}: must be a non-empty string (empty prompts are rejected)")
        if not isinstance(self.negative_prompt, str):
            raise ValueError(f"negative_prompt={self.negative_prompt!r}: must be a string ('' for none)")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed!r}: must be an int in [0, 2**63)")
        for name in ("num_inference_steps", "outputs_per_prompt"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        for name in ("height", "width", "num_frames"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if not _is_number(self.fps) or self.fps <= 0:
            raise ValueError(f"fps={self.fps!r}: must be a finite number > 0")
        if not _is_number(self.guidance_scale) or self.guidance_scale < 1.0:
            raise ValueError(f"guidance_scale={self.guidance_scale!r}: must be a finite number >= 1 (1 disables CFG)")
        if not _is_number(self.shift) or self.shift <= 0:
            raise ValueError(f"shift={self.shift!r}: must be a finite number > 0 (1 = no shift)")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r}: unknown; known: {', '.join(SAMPLERS)}")
        if not isinstance(self.quality, str) or not self.quality:
            raise ValueError(f"quality={self.quality!r}: must be a non-empty string")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora={self.lora!r}: must be None or the name of a loaded adapter")
        if not _is_number(self.lora_scale):
            raise ValueError(f"lora_scale={self.lora_scale!r}: must be a finite number")
        for key, value in self.extra_args.items():
            if not isinstance(key, str) or not _is_json_value(value):
                raise ValueError(
                    f"extra_args[{key!r}]={value!r}: keys must be strings and values JSON scalars or lists of them"
                )
        if config is not None:
            check_video_shape(config, self.height, self.width, self.num_frames)
            limit = config.text_len - 1
            for name in ("prompt", "negative_prompt"):
                size = len(getattr(self, name).encode("utf-8"))
                if size > limit:
                    raise ValueError(
                        f"{name}: {size} UTF-8 bytes, but model {config.name!r} reads at most {limit}: shorten it"
                    )
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; :meth:`from_dict` inverts it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["extra_args"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.extra_args.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Request":
        check_known_fields(cls, data)
        if "prompt" not in data:
            raise ValueError('no "prompt" field: every request needs one, e.g. {"prompt": "a red fox"}')
        return cls(**data)
