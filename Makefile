# The two commands users run: `make reproduce` and `make test`. Each sets itself up from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.dlo_fn-installed
NB_SANITIZE = notebooks/sanitize.cfg

.PHONY: setup lint test test-py test-gpu test-nb reproduce demo notebooks figures clean

setup: $(STAMP)

$(STAMP): pyproject.toml benchmarks/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,test,notebooks]'
	$(PY) -m pip install --quiet --no-deps -e benchmarks
	$(PY) -m ipykernel install --prefix $(VENV) --name python3 >/dev/null
	@touch $@

# The tests and the notebooks in one run over $(WORKERS) processes (pytest-xdist): a file's tests stay together,
# so its module fixtures are shared; each multi-rank spawn that files share runs once, on one worker
# (tests/conftest.py), and the others read its results. One OpenMP thread for every process that sets no count
# of its own (the notebooks' kernels, commands the tests run): the models are tiny, and on a loaded machine a
# second thread mostly spins waiting for a core.
WORKERS ?= 2
test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(WORKERS) --dist loadfile -p no:cacheprovider --nbval --nbval-sanitize-with $(NB_SANITIZE) tests notebooks

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test-py: $(STAMP)
	$(PY) -m pytest tests

# Every test marked cuda, on a machine with a CUDA device (they are skipped elsewhere).
test-gpu: $(STAMP)
	$(PY) -m pytest -m cuda tests

test-nb: $(STAMP)
	$(PY) -m pytest --nbval --nbval-sanitize-with $(NB_SANITIZE) -p no:cacheprovider notebooks

# The main job: the embedded demo (2 CPU ranks over gloo, a generated checkpoint), then every notebook
# executed in place and every figure regenerated (the lab, benchmarks/).
reproduce: $(STAMP)
	$(PY) -m dlo_fn demo
	$(PY) -m benchmarks figures --execute-notebooks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
