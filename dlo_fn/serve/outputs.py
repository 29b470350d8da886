"""What a serve writes under an output folder: every video (``.npy`` + a PNG preview strip) and JSON-lines manifests.

Under ``out_dir``::

    <index>-<id>.npy      uint8 [N, F, H, W, 3], exactly the bytes the SHA-256 covers (N = outputs_per_prompt)
    <index>-<id>.png      preview: one row per output, up to 8 evenly spaced frames side by side
    manifest.jsonl        one line per submission (errors included): id, index, ok, error, settings (every Request
                          field), seed, shape, sha256, rank, wave, position, timings, files, file_sha256, mode,
                          dp_size, sp_size, requests_per_rank, serving, degraded (this request was finished by a
                          degraded ring: why; else null)
    waves.jsonl           strict serving: one line per wave: id, key, request ids per rank (per replica with
                          sp), idle ranks, steps, latency, status
    steps.jsonl           continuous serving: one line per ring step: step, start/end (s from serve start),
                          request ids each rank computed (empty: a gather-only pass), its block-call seconds,
                          requests still queued; and, after a rank was lost, one ``{"degraded": why}`` line

Each request's files and line are written when it finishes (:mod:`dlo_fn.serve.writer`, which also has
``write_outputs`` for a finished report: files
renamed into place, lines appended), so a run that is stopped keeps what it finished; the manifest is rewritten
in submission order at the end. ``<id>`` is the request id with anything but ``[A-Za-z0-9._-]`` replaced by
``_``; the index prefix keeps names unique. The manifest's ``sha256`` is the SHA-256 of the video's uint8 bytes
in C order (``np.load(npy).tobytes()``), not of a file: it is what every mode and world size reproduce; it is
recomputed from the written array and checked against the engine's. ``file_sha256`` maps each written file to
the SHA-256 of its bytes (``sha256sum``), which also depend on the numpy and PIL versions that wrote them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlo_fn.serve.requests import RequestResult, ServeReport

__all__ = [
    "RunInfo",
    "preview_strip",
    "video_sha256",
    "read_manifest",
    "manifest_row",
    "save_video",
    "replace_text",
    "wave_lines",
    "step_lines",
]


def video_sha256(video: Any) -> str:
    """SHA-256 of the C-order bytes of a uint8 video (a tensor or an array)."""
    arr = video.numpy() if hasattr(video, "numpy") else np.asarray(video)
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def preview_strip(video: np.ndarray, max_frames: int = 8) -> np.ndarray:
    """[N, F, H, W, 3] uint8 -> one image [N * H, k * W, 3]: row n = output n, k <= max_frames frames."""
    n, frames = video.shape[:2]
    k = min(frames, max_frames)
    idx = sorted({round(i * (frames - 1) / max(k - 1, 1)) for i in range(k)})
    return np.concatenate([np.concatenate([video[o, i] for i in idx], axis=1) for o in range(n)], axis=0)


def _stem(result: RequestResult) -> str:
    return f"{result.index:04d}-" + re.sub(r"[^A-Za-z0-9._-]", "_", result.request_id)[:80]


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What every manifest line repeats about the run (None where the run never got that far)."""

    mode: str | None = None
    dp_size: int | None = None
    sp_size: int | None = None
    requests_per_rank: int | None = None
    serving: str | None = None

    @classmethod
    def of(cls, report: ServeReport) -> "RunInfo":
        return cls(report.mode, report.dp_size, report.sp_size, report.requests_per_rank, report.serving)


def replace_text(path: pathlib.Path, text: str) -> None:
    """Write ``path`` as a whole or not at all: a temporary name, then an atomic rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_video(out: pathlib.Path, result: RequestResult, *, previews: bool = True) -> list[str]:
    """``result``'s ``.npy`` (and ``.png`` preview), each written under a temporary name and renamed into place;
    the names written (none for a result without a video)."""
    from PIL import Image

    if not result.ok or result.video is None:
        return []
    video = result.video.numpy()
    if video_sha256(video) != result.sha256:
        raise RuntimeError(f"request {result.request_id}: the video's SHA-256 does not match the engine's")
    stem = _stem(result)
    with open(out / f"{stem}.npy.tmp", "wb") as f:
        np.save(f, video)
    os.replace(out / f"{stem}.npy.tmp", out / f"{stem}.npy")
    files = [f"{stem}.npy"]
    if previews:
        Image.fromarray(preview_strip(video)).save(out / f"{stem}.png.tmp", format="PNG", optimize=False)
        os.replace(out / f"{stem}.png.tmp", out / f"{stem}.png")
        files.append(f"{stem}.png")
    return files


def manifest_row(result: RequestResult, info: RunInfo | None, files: list[str], out: pathlib.Path) -> dict[str, Any]:
    """One manifest line (the module docstring lists its fields)."""
    req = result.request
    info = info or RunInfo()
    return {
        "id": result.request_id,
        "index": result.index,
        "ok": result.ok,
        "error": result.error,
        "settings": req.to_dict() if req is not None else None,
        "seed": req.seed if req is not None else None,
        "shape": list(result.shape) if result.shape else None,
        "sha256": result.sha256,
        "rank": result.rank,
        "wave": result.wave_id,
        "position": result.position,
        "timings": {k: round(v, 6) for k, v in sorted(result.timings.items())},
        "files": files,
        "file_sha256": {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in files},
        "mode": info.mode,
        "dp_size": info.dp_size,
        "sp_size": info.sp_size,
        "requests_per_rank": info.requests_per_rank,
        "serving": info.serving,
        "degraded": result.degraded,
    }


def wave_lines(report: ServeReport) -> str:
    ids = {r.index: r.request_id for r in report.results}
    waves = [
        {
            "wave": w.wave_id,
            "key": w.key,
            "ranks": [[ids.get(i, i) for i in idx] for idx in w.rank_indices],
            "idle_ranks": list(w.idle_ranks),
            "lockstep": w.lockstep,
            "steps": w.num_steps,
            "latency_s": round(w.latency_s, 6),
            "status": w.status,
            "error": w.error,
        }
        for w in report.waves
    ]
    return "".join(json.dumps(w, sort_keys=True) + "\n" for w in waves)


def step_lines(report: ServeReport) -> str:
    """``steps.jsonl`` of a continuous serve ("" for strict waves)."""
    if not (report.steps or report.degraded):
        return ""
    ids = {r.index: r.request_id for r in report.results}
    steps = [
        {
            "step": k.step,
            "start_s": round(k.start_s, 6),
            "end_s": round(k.end_s, 6),
            "ranks": [[ids.get(i, i) for i in held] for held in k.held],
            "compute_s": [round(c, 6) for c in k.compute_s],
            "queued": k.num_queued,
        }
        for k in report.steps
    ]
    if report.degraded:
        steps.append({"degraded": report.degraded})
    return "".join(json.dumps(k, sort_keys=True) + "\n" for k in steps)


def read_manifest(path: str | pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
