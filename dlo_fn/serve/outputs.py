"""Write what a serve produced: every video (``.npy`` + a PNG preview strip) and JSON-lines manifests.

Under ``out_dir``::

    <index>-<id>.npy      uint8 [N, F, H, W, 3], exactly the bytes the SHA-256 covers (N = outputs_per_prompt)
    <index>-<id>.png      preview: one row per output, up to 8 evenly spaced frames side by side
    manifest.jsonl        one line per submission, in submission order (errors included):
                          id, index, ok, error, settings (every Request field), seed, shape, sha256, rank,
                          wave, position, timings, files, file_sha256, mode, dp_size, sp_size, requests_per_rank
    waves.jsonl           strict serving: one line per wave: id, key, request ids per rank (per replica with
                          sp), idle ranks, steps, latency, status
    steps.jsonl           continuous serving: one line per ring step: step, start/end (s from serve start),
                          request ids each rank computed (empty: a gather-only pass), its block-call seconds,
                          requests still queued; and, after a rank was lost, one ``{"degraded": why}`` line

``<id>`` is the request id with anything but ``[A-Za-z0-9._-]`` replaced by ``_``; the index prefix keeps
names unique. The manifest's ``sha256`` is the SHA-256 of the video's uint8 bytes in C order
(``np.load(npy).tobytes()``), not of a file: it is what every mode and world size reproduce; it is recomputed
from the written array and checked against the engine's. ``file_sha256`` maps each written file to the
SHA-256 of its bytes (``sha256sum``), which also depend on the numpy and PIL versions that wrote them.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from typing import Any

import numpy as np

from dlo_fn.serve.requests import RequestResult, ServeReport

__all__ = ["write_outputs", "preview_strip", "video_sha256", "read_manifest"]


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


def _row(result: RequestResult, report: ServeReport, files: list[str], out: pathlib.Path) -> dict[str, Any]:
    req = result.request
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
        "mode": report.mode,
        "dp_size": report.dp_size,
        "sp_size": report.sp_size,
        "requests_per_rank": report.requests_per_rank,
        "serving": report.serving,
        "degraded": report.degraded,
    }


def write_outputs(out_dir: str | pathlib.Path, report: ServeReport, *, previews: bool = True) -> pathlib.Path:
    """Write videos, previews and both manifests (see the module docstring); returns the manifest's path."""
    from PIL import Image

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for result in report.results:
        files: list[str] = []
        if result.ok and result.video is not None:
            video = result.video.numpy()
            if video_sha256(video) != result.sha256:
                raise RuntimeError(f"request {result.request_id}: the video's SHA-256 does not match the engine's")
            stem = _stem(result)
            np.save(out / f"{stem}.npy", video)
            files.append(f"{stem}.npy")
            if previews:
                Image.fromarray(preview_strip(video)).save(out / f"{stem}.png", optimize=False)
                files.append(f"{stem}.png")
        rows.append(_row(result, report, files, out))
    manifest = out / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    ids = {r.index: r.request_id for r in report.results}
    waves = [{"wave": w.wave_id, "key": w.key, "ranks": [[ids.get(i, i) for i in idx] for idx in w.rank_indices],
              "idle_ranks": list(w.idle_ranks), "lockstep": w.lockstep, "steps": w.num_steps,
              "latency_s": round(w.latency_s, 6), "status": w.status, "error": w.error} for w in report.waves]
    (out / "waves.jsonl").write_text("".join(json.dumps(w, sort_keys=True) + "\n" for w in waves))
    if report.steps or report.degraded:
        steps = [{"step": k.step, "start_s": round(k.start_s, 6), "end_s": round(k.end_s, 6),
                  "ranks": [[ids.get(i, i) for i in held] for held in k.held],
                  "compute_s": [round(c, 6) for c in k.compute_s], "queued": k.num_queued} for k in report.steps]
        if report.degraded:
            steps.append({"degraded": report.degraded})
        (out / "steps.jsonl").write_text("".join(json.dumps(k, sort_keys=True) + "\n" for k in steps))
    return manifest


def read_manifest(path: str | pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
