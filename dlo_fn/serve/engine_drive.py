"""Rank 0's side of :class:`~dlo_fn.serve.engine.Engine`: lockstep waves and independent queues."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, Sequence

from dlo_fn.plan.waves import WavePlan, assign_positions
from dlo_fn.serve.batch import Outcome, WaveAborted
from dlo_fn.serve.requests import RequestResult, Submission, WaveRecord, to_wire

log = logging.getLogger(__name__)

_POLL_S = 0.02


@contextlib.contextmanager
def _progress(engine: Any, total_steps: int) -> Iterator[None]:
    """A tqdm bar of denoising steps on rank 0 (stderr; by default only on a terminal)."""
    from tqdm.auto import tqdm

    enabled = engine.options.progress
    bar = tqdm(total=total_steps, unit="step", desc=f"{engine.mode} W={engine.world_size}",
               disable=None if enabled is None else not enabled, leave=False)
    engine.tick = lambda: bar.update(1)
    try:
        yield
    finally:
        engine.tick = None
        bar.close()


def _steps(subs: Sequence[Submission], wave: WavePlan) -> int:
    return subs[wave.indices[0]].request.num_inference_steps


def _shares(subs: Sequence[Submission], wave: WavePlan) -> list[list[tuple[int, Any]]]:
    return [[(p, to_wire(subs[wave.indices[p]].request)) for p in pos] for pos in assign_positions(len(wave.indices),
                                                                                         wave.dp_size)]


def _relative(trace: list, t_start: float) -> tuple:
    return tuple((r, lane, label, s - t_start, e - t_start) for r, lane, label, s, e in trace)


def _fill(engine: Any, subs, results, wave: WavePlan, outcomes: dict[int, list[Outcome]], *, queued_s: float,
          wave_s: float) -> str:
    """Match outcomes to requests by wave position; returns the wave status (ok / partial)."""
    from dlo_fn.serve.engine import request_result

    owner = {p: r for r, pos in enumerate(assign_positions(len(wave.indices), wave.dp_size)) for p in pos}
    got = {o.position: (rank, o) for rank, outs in outcomes.items() for o in outs}
    status = "ok"
    for p, i in enumerate(wave.indices):
        rank, o = got.get(p, (owner[p], None))
        err = None if o is not None else f"rank {owner[p]} returned no result for wave {wave.wave_id} position {p}"
        results[i] = request_result(i, subs[i], o, rank=rank, wave_id=wave.wave_id, position=p,
                                    queued_s=queued_s, wave_s=wave_s, error=err)
        if not results[i].ok:
            status = "partial"
    return status


def _fail_wave(engine: Any, subs, results, wave: WavePlan, reason: str, *, queued_s: float, wave_s: float,
               owner_rank: int | None = None) -> None:
    owners = {p: r for r, pos in enumerate(assign_positions(len(wave.indices), wave.dp_size)) for p in pos}
    for p, i in enumerate(wave.indices):
        results[i] = RequestResult(i, subs[i].request_id, subs[i].request, False, error=reason,
                                   rank=owner_rank if owner_rank is not None else owners[p],
                                   wave_id=wave.wave_id, position=p,
                                   timings={"queued_s": queued_s, "wave_s": wave_s})


def lockstep(engine: Any, waves: Sequence[WavePlan], subs, results: dict, t0: float) -> list[WaveRecord]:
    """Allgather mode: one wave at a time, every rank in it (see the engine's module docstring)."""
    records: list[WaveRecord] = []
    world = engine.world_size
    with _progress(engine, sum(_steps(subs, w) for w in waves)):
        for wave in waves:
            steps, shares = _steps(subs, wave), _shares(subs, wave)
            trace: list | None = [] if engine.options.trace else None
            t_start = time.perf_counter()
            queued_s = t_start - t0
            stage = "broadcasting the wave"
            try:
                engine.channel.broadcast({"kind": "wave", "wave": wave.wave_id, "steps": steps, "shares": shares,
                                          "trace": trace is not None})
                if trace is not None:
                    trace.append((0, "control", "broadcast", t_start, time.perf_counter()))
                stage = "running its own share"
                outcomes = {0: engine.run_share(wave.wave_id, steps, shares[0], trace)}
                engine.board.post("done", wave=wave.wave_id)
                for r in range(1, world):
                    stage = f"receiving rank {r}'s results"
                    c0 = time.perf_counter()
                    reply = engine.channel.recv(r)
                    if trace is not None:
                        trace.append((0, "control", f"recv r{r}", c0, time.perf_counter()))
                        trace.extend(reply.get("trace") or ())
                    if reply.get("wave") != wave.wave_id:
                        raise RuntimeError(f"rank {r} answered for wave {reply.get('wave')}, not {wave.wave_id}")
                    outcomes[r] = reply["outcomes"]
            except Exception as exc:  # noqa: BLE001 - every failure ends the wave closed, with a reason
                if isinstance(exc, WaveAborted):
                    engine.board.post("collective-failed", wave=wave.wave_id, error=str(exc))
                reason = engine.fail(wave.wave_id, stage, exc, range(1, world))
                wave_s = time.perf_counter() - t_start
                _fail_wave(engine, subs, results, wave, reason, queued_s=queued_s, wave_s=wave_s)
                records.append(WaveRecord(wave.wave_id, wave.key.short(), wave.rank_indices, steps, wave_s,
                                          "failed", reason))
                break
            wave_s = time.perf_counter() - t_start
            status = _fill(engine, subs, results, wave, outcomes, queued_s=queued_s, wave_s=wave_s)
            errors = sorted({results[i].error for i in wave.indices if not results[i].ok})
            records.append(WaveRecord(wave.wave_id, wave.key.short(), wave.rank_indices, steps, wave_s, status,
                                      "; ".join(errors) or None,
                                      _relative(trace, t_start) if trace is not None else ()))
            log.info("wave %d: %d request(s) on %d rank(s), %s, %.3f s", wave.wave_id, len(wave.indices),
                     world - len(wave.idle_ranks), status, wave_s)
    return records


def independent(engine: Any, waves: Sequence[WavePlan], subs, results: dict, t0: float) -> list[WaveRecord]:
    """Rank-local / resident: one queue per rank, no lockstep; results collected rank by rank."""
    world = engine.world_size
    queues: list[list[WavePlan]] = [[] for _ in range(world)]
    for j, wave in enumerate(waves):
        queues[j % world].append(wave)
    round_id = engine._round
    engine._round += 1
    trace: list | None = [] if engine.options.trace else None
    msg_queues = [[(w.wave_id, _steps(subs, w), _shares(subs, w)[0]) for w in q] for q in queues]
    t_start = time.perf_counter()
    owner = {w.wave_id: r for r, q in enumerate(queues) for w in q}
    by_id = {w.wave_id: w for w in waves}
    records: dict[int, WaveRecord] = {}
    if world > 1 and waves:
        try:
            engine.channel.broadcast({"kind": "round", "round": round_id, "queues": msg_queues,
                                      "trace": trace is not None})
        except Exception as exc:  # noqa: BLE001
            reason = engine.fail(None, "broadcasting the queues", exc, range(1, world),
                                 what=f"round {round_id} (waves {', '.join(str(w.wave_id) for w in waves)})")
            for w in waves:
                _fail_wave(engine, subs, results, w, reason, queued_s=0.0, wave_s=0.0, owner_rank=owner[w.wave_id])
            return []
    outcomes: dict[int, list[Outcome]] = {}
    with _progress(engine, sum(s for _, s, _ in msg_queues[0])):
        for wave_id, steps, share in msg_queues[0]:
            outcomes[wave_id] = engine.run_share(wave_id, steps, share, trace)
    engine.board.post("done", round=round_id)
    for r in range(1, world):
        if not queues[r]:
            continue
        failure = _await_done(engine, r, round_id)
        stage = f"collecting rank {r}'s queue"
        if failure is None:
            try:
                engine.board.set_flag(f"go/{round_id}/{r}")
                reply = engine.channel.recv(r)
                for wave_id, outs in reply["outcomes"]:
                    outcomes[wave_id] = outs
                if trace is not None:
                    trace.extend(reply.get("trace") or ())
                continue
            except Exception as exc:  # noqa: BLE001
                failure = exc
        reason = engine.fail(None, stage, failure, [r],
                             what=f"rank {r}'s queue (waves {', '.join(str(w.wave_id) for w in queues[r])})")
        for w in queues[r]:
            _fail_wave(engine, subs, results, w, reason, queued_s=0.0, wave_s=time.perf_counter() - t_start,
                       owner_rank=r)
            records[w.wave_id] = WaveRecord(w.wave_id, w.key.short(), _spread(w, r, world), _steps(subs, w),
                                            time.perf_counter() - t_start, "failed", reason, lockstep=False)
    for wave_id, outs in outcomes.items():
        w, r = by_id[wave_id], owner[wave_id]
        compute_s = max((o.compute_s for o in outs), default=0.0)
        status = _fill(engine, subs, results, w, {0: outs}, queued_s=t_start - t0, wave_s=compute_s)
        for i in w.indices:  # the batch ran on rank r, not rank 0
            results[i] = _with_rank(results[i], r)
        errors = sorted({results[i].error for i in w.indices if not results[i].ok})
        records[wave_id] = WaveRecord(wave_id, w.key.short(), _spread(w, r, world), _steps(subs, w), compute_s,
                                      status, "; ".join(errors) or None, lockstep=False)
    out = [records[k] for k in sorted(records)]
    if trace is not None and out:
        out[0] = _replace_trace(out[0], _relative(trace, t_start))
    return out


def _spread(w: WavePlan, rank: int, world: int) -> tuple[tuple[int, ...], ...]:
    return tuple(w.indices if r == rank else () for r in range(world))


def _with_rank(res: RequestResult, rank: int) -> RequestResult:
    import dataclasses

    return dataclasses.replace(res, rank=rank)


def _replace_trace(rec: WaveRecord, trace: tuple) -> WaveRecord:
    import dataclasses

    return dataclasses.replace(rec, trace=trace)


def _await_done(engine: Any, rank: int, round_id: int) -> BaseException | None:
    """Wait on the board until ``rank`` finished its queue; a dead rank or no progress for ``timeout_s``
    returns the failure (a ``TimeoutError``) instead."""
    board, timeout_s = engine.board, engine.options.timeout_s
    started = last_beat = time.monotonic()
    while True:
        rec = board.read(rank)
        if rec is not None and rec.get("state") == "done" and rec.get("round") == round_id:
            return None
        if board.alive(rec) is False:
            return RuntimeError(f"rank {rank}'s process exited before finishing its queue")
        if board.store is None:
            return None  # no board: fall back to the bounded recv
        if rec is not None and board.age_s(rec) >= timeout_s:
            return TimeoutError(f"rank {rank} made no progress for {board.age_s(rec):.1f} s (timeout_s {timeout_s})")
        if rec is None and time.monotonic() - started >= timeout_s:
            return TimeoutError(f"rank {rank} never posted a status within {timeout_s} s")
        if time.monotonic() - last_beat >= 1.0:
            board.post("collecting", round=round_id)  # keep rank 0 visibly alive for the waiting followers
            last_beat = time.monotonic()
        time.sleep(_POLL_S)
