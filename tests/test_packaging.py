"""The install paths agree: environment.yml installs exactly what pyproject.toml and the Makefile install."""

from __future__ import annotations

import pathlib
import re

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _env_pip_lines() -> list[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*- pip:\s*$", line))
    return [m.group(1).strip() for line in lines[start + 1 :] if (m := re.match(r"\s+- (.+)$", line))]


def test_environment_yml_installs_the_package_with_the_makefile_extras():
    project = _pyproject()["project"]
    extras = set(project["optional-dependencies"])
    (pip_line,) = _env_pip_lines()
    m = re.fullmatch(r"-e \.\[([\w,]+)\]", pip_line)
    assert m, pip_line
    env_extras = set(m.group(1).split(","))
    assert env_extras <= extras
    make = (ROOT / "Makefile").read_text()
    make_extras = set(re.search(r"-e '\.\[([\w,]+)\]'", make).group(1).split(","))
    assert env_extras == make_extras == {"cpu", "test", "notebooks"}


def test_environment_yml_python_matches_requires_python():
    text = (ROOT / "environment.yml").read_text()
    assert "conda-forge" in text
    assert re.search(r"- python=3\.11\b", text)
    assert re.search(r"^\s+- pip$", text, re.M)
    assert _pyproject()["project"]["requires-python"] == ">=3.10"


def test_torch_pins_agree():
    project = _pyproject()["project"]
    assert "torch==2.13.0" in project["optional-dependencies"]["cpu"]
    assert any(d.startswith("torch>=") for d in project["dependencies"])
    # functorch is torch.func now; the standalone wheel pins torch 2.0 and must never come back.
    everything = project["dependencies"] + sum(project["optional-dependencies"].values(), [])
    assert not any(re.match(r"functorch\b", d) for d in everything)


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci/run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert readme.index("make reproduce") < readme.index("make test") < 2000
