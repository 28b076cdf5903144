# Two front doors: `make demo` and `make test`. Both create or reuse .venv.
# `make test-fast`: the tier without multi-process or long tests, for edit-test loops.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-full browser venv clean wheelhouse bench-search bench-capture bench-kernels

venv: $(STAMP)

# torch is pinned to the CPU build that lies on local disk; an unpinned torch
# would pull a multi-GB CUDA build. The package itself accepts torch>=2.11.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=68" wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m autoshard.demo

# Headless chromium for tests/test_report_browser.py (renders `autoshard report` pages). Installed with apt
# when missing; where apt is unavailable (not root, not Debian) this only warns and that test skips.
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) \
		|| echo "warning: chromium not installed; tests/test_report_browser.py will skip"

# One pytest worker per core (pytest-xdist), whole files per worker: a file's module fixtures (its spawned
# gloo jobs) run once. TEST_WORKERS=0 runs in this process, in file order.
TEST_WORKERS ?= auto
test: $(STAMP) browser
	TRITON_INTERPRET=1 $(PY) -m pytest tests -m "not gpu and not full" -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15

# No spawned ranks or subprocess runs, nothing over about 2 s (marker `slow`): ~2 min on 2 cores.
test-fast: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest tests -m "not slow and not gpu and not full" -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15

# Every case of every matrix (tests/_tiers.py): CI's `make test` runs one case per code path.
test-full: $(STAMP) browser
	AUTOSHARD_TESTS=full TRITON_INTERPRET=1 $(PY) -m pytest tests -m "not gpu" -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15

bench-capture: $(STAMP)
	$(PY) benchmarks/capture_bench.py

bench-search: $(STAMP)
	$(PY) benchmarks/search_bench.py

# GPU only (not CI); on CPU `--smoke` runs the same logic under the Triton interpreter.
bench-kernels: $(STAMP)
	$(PY) benchmarks/kernels_bench.py

wheelhouse:
	$(PYTHON) scripts/build_wheelhouse.py --python-version 3.12 --out .whl

clean:
	rm -rf $(VENV) build dist *.egg-info
