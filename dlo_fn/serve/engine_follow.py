"""The followers' side of :class:`~dlo_fn.serve.engine.Engine` (ranks != 0)."""

from __future__ import annotations

import logging
import time
from typing import Any

from dlo_fn.serve.batch import WaveAborted

log = logging.getLogger(__name__)

_POLL_S = 0.02


def follow(engine: Any) -> None:
    """Serve rank 0's messages until ``stop`` or a failure (after which the group is unusable)."""
    last_wave = None
    while True:
        try:
            msg = engine.channel.broadcast(None)
        except Exception as exc:  # noqa: BLE001 - rank 0 stopped answering: nothing more to serve
            engine.board.post("collective-failed", wave=None if last_wave is None else last_wave + 1,
                              error=f"waiting for the next wave: {type(exc).__name__}: {exc}")
            log.error("rank %d: lost rank 0 while waiting for work: %s", engine.rank, exc)
            engine.stopped = f"lost rank 0 while waiting for work: {exc}"
            return
        kind = msg.get("kind")
        if kind == "stop":
            engine.board.post("idle")
            return
        if kind == "idle":  # rank 0 is waiting for requests: nothing to do, wait again
            continue
        if kind == "wave":
            last_wave = msg["wave"]
            ok = _wave(engine, msg)
        elif kind == "round":
            ok = _round(engine, msg)
        else:
            raise RuntimeError(f"rank {engine.rank}: unknown message kind {kind!r} from rank 0")
        if not ok:
            engine.stopped = engine.stopped or f"rank {engine.rank} stopped following after a failed exchange"
            return


def _wave(engine: Any, msg: dict) -> bool:
    wave_id, rank = msg["wave"], engine.rank
    trace: list | None = [] if msg.get("trace") else None
    if trace is not None:
        trace.append((rank, "control", "wave received", time.perf_counter(), time.perf_counter()))
    try:
        outcomes = engine.run_share(wave_id, msg["steps"], msg["shares"][rank], trace)
    except WaveAborted as exc:
        engine.board.post("collective-failed", wave=wave_id, error=str(exc))
        log.error("rank %d: wave %d aborted: %s", rank, wave_id, exc)
        return False
    failed = [o for o in outcomes if not o.ok]
    engine.board.post("error" if failed else "done", wave=wave_id,
                      **({"error": failed[0].error} if failed else {}))
    try:
        engine.channel.send({"wave": wave_id, "rank": rank, "outcomes": outcomes, "trace": trace})
    except Exception as exc:  # noqa: BLE001
        engine.board.post("collective-failed", wave=wave_id, error=f"sending results: {exc}")
        log.error("rank %d: could not send wave %d's results: %s", rank, wave_id, exc)
        return False
    return True


def _round(engine: Any, msg: dict) -> bool:
    """Independent mode: run this rank's queue, post done, wait for rank 0's go, send everything."""
    round_id, rank, board = msg["round"], engine.rank, engine.board
    queue = msg["queues"][rank]
    if not queue:
        return True
    trace: list | None = [] if msg.get("trace") else None
    results = []
    for wave_id, steps, share in queue:
        try:
            results.append((wave_id, engine.run_share(wave_id, steps, share, trace)))
        except WaveAborted as exc:  # no collectives in this mode: report it as the batch's errors
            from dlo_fn.serve.batch import Outcome

            results.append((wave_id, [Outcome(p, False, error=str(exc)) for p, _ in share]))
    board.post("done", round=round_id)
    timeout_s = engine.options.timeout_s
    while not board.has_flag(f"go/{round_id}/{rank}"):
        rec = board.read(0)
        if board.store is None:
            break
        if rec is not None and board.age_s(rec) >= timeout_s:
            log.error("rank %d: rank 0 made no progress for %.1f s; giving up on round %d", rank,
                      board.age_s(rec), round_id)
            return False
        time.sleep(_POLL_S)
    try:
        engine.channel.send({"round": round_id, "rank": rank, "outcomes": results, "trace": trace})
    except Exception as exc:  # noqa: BLE001
        board.post("collective-failed", round=round_id, error=f"sending results: {exc}")
        return False
    return True
