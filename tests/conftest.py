"""Shared test settings."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread_from_the_start():
    """One thread before any module or session fixture runs too (pytest sets those up before a test's own
    fixtures): a bench run in a module fixture spent most of its time in OpenMP spinning on two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """A test marked ``cuda`` runs CUDA code (``make test-gpu`` selects them); without CUDA it is skipped, unless
    it is marked ``cuda(cpu=True)``: it runs on the CPU too, its CUDA part only where CUDA is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is not None and not marker.kwargs.get("cpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and OpenMP spinning on a shared 2-core machine is slow. Tests that
    check thread independence set their own counts."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The tiny reference DiT (bf16, seed 0) written once for the whole run; tests only read it."""
    from dlo_fn.models import write_checkpoint

    return str(write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, progress=False))


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint: str) -> str:
    return tiny_checkpoint


def resident_expected(checkpoint: str, requests) -> dict:
    """Every request with a prompt run alone on the resident model, by the id ``as_submissions`` gives it
    (``req0000``, ...): the bytes every served output must equal."""
    from dlo_fn.models import generate
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import platform_for
    from dlo_fn.serve.local import open_model

    torch.set_num_threads(1)
    # On the CPU, where serve_local and run_ranks put the ranks it is compared with: a CUDA reference on a GPU
    # machine runs other kernels and gives other bytes.
    model, _ = open_model(checkpoint, init_distributed(platform_for("cpu")), "resident")
    return {f"req{i:04d}": generate(model, r) for i, r in enumerate(requests) if r.prompt}


MIXED_SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)


def mixed_request(prompt: str, seed: int, **kw):
    """A tiny request of :data:`MIXED_SHAPE`, fields overridden by ``kw``."""
    from dlo_fn.models.request import Request

    return Request(prompt=prompt, seed=seed, **{**MIXED_SHAPE, **kw})


def mixed_requests() -> tuple:
    """The continuous-serving trace: two heights, three step counts, CFG on and off, another guidance, one
    empty prompt (rejected), and one image (``num_frames=1``)."""
    r = mixed_request
    return (
        r("a red fox", 1),
        r("a blue bird", 2, num_inference_steps=5),
        r("a tall tree", 3, height=48),
        r("a cat", 4, guidance_scale=1.0),
        r("", 5),
        r("a boat", 6, num_inference_steps=2),
        r("a red fox", 7, guidance_scale=3.0, num_frames=1),
    )


@pytest.fixture(scope="session")
def mixed_expected(checkpoint):
    """:func:`resident_expected` of the :func:`mixed_requests` trace, computed once for the continuous tests."""
    return resident_expected(checkpoint, mixed_requests())


def engine_options(**kw):
    """Engine options for multi-rank tests: small timeouts, no progress bar (the serving mode is the default
    unless given)."""
    from dlo_fn.serve.requests import EngineOptions

    return EngineOptions(**{"timeout_s": 4.0, "grace_s": 1.0, "progress": False, **kw})


# `generate` end to end (test_generate_cli, test_policy_generate): 3 requests on 2 ranks, wave 1 partial.
GENERATE_ARGS = (
    "--steps",
    "2",
    "--height",
    "32",
    "--width",
    "32",
    "--frames",
    "5",
    "--seed",
    "3",
    "--prompt",
    "a fox",
    "--prompt",
    "an owl",
    "--prompt",
    "a cat",
)


def run_generate(ckpt, out, *extra, nproc=1, timeout=240):
    """``python -m dlo_fn generate`` of :data:`GENERATE_ARGS` as users run it (under torchrun when ``nproc`` > 1):
    exit code 0, each output's file hashes to its manifest row and has its shape, a non-empty PNG.
    Returns ``(stdout + stderr, manifest rows)``."""
    import hashlib
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    from dlo_fn.runtime.dist import free_port

    args = ["-m", "dlo_fn", "generate", "--checkpoint", ckpt, "--out", str(out), *GENERATE_ARGS, *extra]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu")
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    for row in rows:
        npy, png = row["files"]
        video = np.load(out / npy)
        assert hashlib.sha256(video.tobytes()).hexdigest() == row["sha256"]
        assert (out / png).stat().st_size > 0
        assert list(video.shape) == row["shape"]
    return proc.stdout + proc.stderr, rows


@pytest.fixture(scope="session")
def resident_rows(checkpoint, tmp_path_factory) -> list:
    """``generate --resident`` of :data:`GENERATE_ARGS`, one process, run once: the bytes every torchrun run of
    the same requests must write."""
    return run_generate(checkpoint, tmp_path_factory.mktemp("resident"), "--resident")[1]


# Shared spawns. Process start-up costs more than most multi-rank scenarios on this 2-core machine: each rank
# imports torch (~2.5 s of CPU), and diffusers + transformers (~6 s more) for the third-party models. So the
# run_ranks scenarios below share one spawn per world size: every rank runs them in the order listed, each in
# its own try, and each test reads its own scenario's results (a failure names its scenario, with every failing
# rank's traceback). A scenario runs only when a test of its module was collected; the spawns run in the
# background from the start of the session (shared_spawns). Kept on processes of their
# own: what measures the process's memory (test_release, test_bench_load), serve_local runs
# (their faults break the group) and the command lines.
@dataclass(frozen=True)
class FixtureArg:
    """An argument of a scenario that is the value of this (session) fixture."""

    name: str


SCENARIOS = {  # world size -> name -> (module, function(ctx, *args), args)
    2: {
        "mesh": ("test_mesh", "_rank", ()),  # first: its mistakes are made before any group exists
        "wire": ("test_wire", "_channel_rank", ()),
        # Before anything else maps the tiny checkpoint: its streamed blocks must be what keeps the file mapped.
        **{
            f"host_budget[{mode}]": ("test_host_budget", "_budget_rank", (FixtureArg("tiny_checkpoint"), mode))
            for mode in ("allgather", "rank-local")
        },
        "engine_mesh": ("test_engine_mesh", "_rank", (FixtureArg("six_heads"),)),
        "executor_dist": ("test_executor_dist", "check_rank", (FixtureArg("tiny_checkpoint"), True)),
        "third_party": ("test_third_party", "check_folders_rank", (FixtureArg("third_party_folders"),)),
        "pipeline": ("test_pipeline", "check_rank", (FixtureArg("wan_pipeline_folder"),)),
        "context_parallel": ("test_context_parallel", "_rank", ()),
        "quant": ("test_quant", "quant_rank", (FixtureArg("tiny_checkpoint"),)),
        "quantize": ("test_quantize", "quantize_rank", (FixtureArg("quantized_tiny"),)),
        "offload_ready": ("test_offload_ready", "_rank", (FixtureArg("tiny_checkpoint"),)),
        "lora": ("test_lora", "lora_rank", ()),
        "models_lora": ("test_models_lora", "lora_rank", (FixtureArg("tiny_checkpoint"),)),
        "serve_lora": ("test_serve_lora", "serve_rank", (FixtureArg("tiny_checkpoint"),)),
        "policy_api": ("test_policy_api", "_rank", ()),
    },
    3: {
        "models_sp": ("test_models_sp", "_rank", ()),
        "engine_mesh": ("test_engine_mesh", "_rank", (FixtureArg("six_heads"),)),
        "third_party": ("test_third_party", "check_folders_rank", (FixtureArg("third_party_folders"),)),
        "quant": ("test_quant", "quant_rank", (FixtureArg("tiny_checkpoint"),)),
    },
    4: {
        "mesh": ("test_mesh", "_rank", ()),
        "engine_mesh": ("test_engine_mesh", "_rank", (FixtureArg("six_heads"),)),
        "engine_mesh_fp8": ("test_engine_mesh", "_fp8_rank", (FixtureArg("six_heads"),)),
        "engine_mesh_lora": ("test_engine_mesh", "_lora_rank", (FixtureArg("six_heads"),)),
        "executor_dist": ("test_executor_dist", "check_rank", (FixtureArg("tiny_checkpoint"), False)),
    },
}
SHARED_TIMEOUT_S = 480.0  # the whole spawn, and each collective's process-group timeout


def run_scenarios(ctx, scenarios: dict) -> dict:
    """On one rank: each scenario in turn; name -> (True, its result pickled) or (False, the traceback). What a
    scenario left behind (its models, the mappings they hold) is collected before the next one starts."""
    import gc
    import importlib
    import os
    import pickle
    import traceback

    os.nice(19)  # yield to the tests' own processes (a forked rank has its fork server's niceness)
    out = {}
    for name, (module, function, args) in scenarios.items():
        try:
            out[name] = (True, pickle.dumps(getattr(importlib.import_module(module), function)(ctx, *args)))
        except BaseException as exc:  # noqa: BLE001 - reported by the scenario's test; the next one still runs
            out[name] = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        gc.collect()
    return out


class SharedSpawns:
    """The shared spawns of one pytest process. Under pytest-xdist every worker collects every test, so each
    would start every spawn; instead each world size belongs to one worker (round robin over the worker ids),
    which runs it and writes every rank's results to a file in the run's temporary folder; a test on another
    worker reads that file. A world that no worker started (a worker that got no tests) is run by the first
    test that needs it. One pytest process without xdist owns every world."""

    def __init__(self, request, tmp_path_factory) -> None:
        import concurrent.futures
        import multiprocessing.forkserver
        import os

        from dlo_fn.serve.ranks import rank_context

        worker = os.environ.get("PYTEST_XDIST_WORKER")
        # Every worker's base folder lies in the run's own folder, made fresh for each run.
        self.folder = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
        # (notebook cells, collected in the same run by nbval, have no module)
        selected = {getattr(getattr(item, "module", None), "__name__", None) for item in request.session.items}
        self.scenarios = {
            world: {name: job for name, job in scenarios.items() if job[0] in selected}
            for world, scenarios in SCENARIOS.items()
        }
        worlds = sorted(w for w, jobs in self.scenarios.items() if jobs)
        index, count = (int(worker[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])) if worker else (0, 1)
        # The ranks are forked from a fork server (they skip importing torch), started here in pytest's thread
        # so that it, and the ranks of the tests that use it too, are not niced (run_scenarios nices its own).
        rank_context("forkserver")
        multiprocessing.forkserver.ensure_running()
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "shared-spawns", initializer=os.nice, initargs=(19,))
        self.owned = {}
        for world in worlds[index::count]:
            if self._claim(world):
                jobs = self._jobs(request, world)  # fixtures are set up here, in pytest's thread
                self.owned[world] = self.pool.submit(self._run, world, jobs)

    def _path(self, world: int, suffix: str):
        return self.folder / f"shared-spawn-{world}.{suffix}"

    def _claim(self, world: int) -> bool:
        import os

        try:
            os.close(os.open(self._path(world, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def _jobs(self, request, world: int) -> dict:
        def value(a):
            return request.getfixturevalue(a.name) if isinstance(a, FixtureArg) else a

        return {name: (m, f, tuple(map(value, args))) for name, (m, f, args) in self.scenarios[world].items()}

    def _run(self, world: int, jobs: dict) -> None:
        """Run the spawn and publish what it gave (every rank's results, or why it failed), atomically."""
        import os
        import pickle

        from dlo_fn.serve.ranks import run_ranks

        try:
            ranks = run_ranks(run_scenarios, world, jobs, timeout_s=SHARED_TIMEOUT_S, start_method="forkserver")
            answer = (True, ranks)
        except BaseException as exc:  # noqa: BLE001 - every test of this world reports it
            answer = (False, f"the shared spawn of {world} ranks failed: {type(exc).__name__}: {exc}")
        part = self._path(world, "part")
        part.write_bytes(pickle.dumps(answer))
        os.replace(part, self._path(world, "pickle"))

    def results(self, request, world: int) -> list:
        """Every rank's results of the spawn of ``world`` ranks, waiting for it if it runs elsewhere."""
        import pickle
        import time

        if world in self.owned:
            self.owned[world].result()
        path, deadline = self._path(world, "pickle"), time.monotonic() + 3 * SHARED_TIMEOUT_S
        while not path.exists():
            if self._claim(world):  # nobody started it, or its owner ended before it started (see close)
                self._run(world, self._jobs(request, world))
            elif time.monotonic() > deadline:
                pytest.fail(f"the shared spawn of {world} ranks (another worker's) gave no results", pytrace=False)
            time.sleep(0.2)
        ok, value = pickle.loads(path.read_bytes())
        if not ok:
            pytest.fail(value, pytrace=False)
        return value

    def close(self) -> None:
        """At the end of this process's tests: a spawn not started yet is given up (its claim too, so that a
        worker still waiting for it runs it); one in progress ends, or times out and kills its ranks."""
        for world, future in self.owned.items():
            if future.cancel():
                self._path(world, "claim").unlink()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="session", autouse=True)
def shared_spawns(request, tmp_path_factory):
    """The :class:`SharedSpawns` of this process. Its spawns start with the session, one after the other in a
    thread of their own, on niced ranks, so they use the core that the single-process tests leave idle and
    yield to everything else; a test that needs one waits for it."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    # The semaphore tracker that every spawn shares starts here, under pytest's capture as it did when the
    # first spawn came from a test (a thread could start it between tests, and its exit-time warning about
    # serve_local's ranks' semaphores would then reach the terminal).
    multiprocessing.resource_tracker.ensure_running()
    spawns = SharedSpawns(request, tmp_path_factory)
    yield spawns
    spawns.close()
    # The fork server (and with it the CPU time of the ranks it forked) is reaped here rather than left to exit
    # on its own after this process: the time it took is then counted for whoever waits on pytest. (A private
    # hook of CPython's fork server; where it is missing the server exits with this process as before.)
    stop = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()


def scenario(request, world: int, name: str) -> list:
    """Every rank's result of scenario ``name`` on ``world`` ranks (the shared spawn runs when first asked)."""
    import pickle

    results = [rank_out[name] for rank_out in request.getfixturevalue("shared_spawns").results(request, world)]
    failed = [f"--- rank {r} ---\n{text}" for r, (ok, text) in enumerate(results) if not ok]
    if failed:
        pytest.fail(f"scenario {name!r} on {world} ranks failed:\n" + "\n".join(failed), pytrace=False)
    return [pickle.loads(value) for _, value in results]


@pytest.fixture(scope="session")
def six_heads(tmp_path_factory) -> str:
    """The reference DiT with 6 heads (sp 2 and 3 divide them), bf16, seed 0."""
    from test_engine_mesh import SIX_HEADS

    from dlo_fn.models import write_checkpoint

    return str(write_checkpoint(SIX_HEADS, tmp_path_factory.mktemp("ckpt") / "six", seed=0, progress=False))


@pytest.fixture(scope="session")
def quantized_tiny(tiny_checkpoint, tmp_path_factory) -> tuple[str, str]:
    """The tiny checkpoint and its FP8 copy (``python -m dlo_fn quantize``), written once."""
    from dlo_fn.runtime.quantize import quantize_checkpoint

    dst = tmp_path_factory.mktemp("quantized") / "tiny-fp8"
    quantize_checkpoint(tiny_checkpoint, dst, progress=False)
    return tiny_checkpoint, str(dst)


@pytest.fixture(scope="session")
def third_party_folders(tmp_path_factory) -> str:
    from test_third_party import write_folders

    return write_folders(tmp_path_factory.mktemp("third_party"))


@pytest.fixture(scope="session")
def wan_pipeline_folder(tmp_path_factory) -> str:
    from test_pipeline import tiny_wan_pipeline

    folder = tmp_path_factory.mktemp("pipeline") / "wan-pipeline"
    tiny_wan_pipeline().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def ckpt_200mb(tmp_path_factory) -> str:
    """The 216 MB load-benchmark checkpoint (bench.load), written once: test_release and test_bench_load only
    read it."""
    from benchmarks.bench.load import make_checkpoint

    return str(make_checkpoint("load-200mb", tmp_path_factory.mktemp("load200")))
