"""What a user pays for at import: the README's API (``offload``, ``load_model``, ``init_distributed``) loads the
plan, the runtime core and checkpoint I/O, not the reference model, the analytic models (loaded when
``mode="auto"`` or a planner command asks), the FP8 modules (loaded when quantisation is asked for or a quantised
checkpoint is loaded), the serving engine, the plug-ins or the lab. Run in a fresh
interpreter, so other tests' imports do not count."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The README's API in lines of dlo_fn source (physical lines in the formatter's layout): the 5,000 lines were
# counted before `ruff format`, which grew the same files by 20% (29,398 -> 35,348 lines), so 6,000 here. The FP8
# modules, the start-up plug-ins, the memory models and the Timeline machinery load on demand.
API_LINE_BUDGET = 6_000

PROBE = """
import json, sys
import dlo_fn.runtime.offload, dlo_fn.io.load, dlo_fn.runtime.dist
ours = [m for m in sys.modules if m.split(".")[0] in ("dlo_fn", "benchmarks")]
files = {m: sys.modules[m].__file__ for m in ours if getattr(sys.modules[m], "__file__", None)}
print(json.dumps({m: len(open(f).read().splitlines()) for m, f in files.items()}))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, int]:
    """Module -> its lines, for what the probe loaded: one fresh interpreter for both tests."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def test_the_readme_api_loads_the_core_only(loaded):
    mods = loaded
    unwanted = [
        m
        for m in mods
        if m.startswith(("dlo_fn.models", "dlo_fn.cost", "dlo_fn.serve", "dlo_fn.cli", "dlo_fn.runtime.cuda"))
        or m.startswith("benchmarks")
        or m
        in (
            "dlo_fn.runtime.auto",
            "dlo_fn.runtime.probe",
            "dlo_fn.plan.timeline",
            "dlo_fn.io.memstat",
            "dlo_fn.io.quantized",
            "dlo_fn.runtime.quant",
        )
    ]
    assert not unwanted, f"the README's API loads {sorted(unwanted)}"


def test_the_readme_api_loads_at_most_its_line_budget(loaded):
    mods = loaded
    total = sum(mods.values())
    assert total <= API_LINE_BUDGET, "\n".join(f"{n:6d} {m}" for m, n in sorted(mods.items(), key=lambda x: -x[1]))
