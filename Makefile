# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-quick test-cluster test-learning lint format compare install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so the project's loose `torch` requirement is already met by the CPU wheel.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/proximal demo $(DEMO_ARGS)

# PPO, DPO, SimPO, GRPO and RLOO on the built-in task, 3 seeds each (about 5 minutes on 2 cores):
# compare_out/compare.md. COMPARE_ARGS adds overrides, e.g. COMPARE_ARGS="--compare.seeds 5".
# Then the online methods on the arithmetic reasoning task: compare_out/arithmetic/compare.md.
compare: $(STAMP)
	$(VENV)/bin/proximal compare --output.dir compare_out $(COMPARE_ARGS)
	$(VENV)/bin/proximal compare --compare.task arithmetic --output.dir compare_out/arithmetic $(COMPARE_ARGS)

# Every test but those marked `cluster` (multi-process pre-emption, torchrun elastic restarts and
# multi-node rendezvous: tens of seconds each), which `make test-cluster` runs, and those marked
# `learning` (learning over several seeds: minutes each), which `make test-learning` runs.
# TEST_WORKERS pytest-xdist processes share the files (a file's tests stay in one worker, so a module
# fixture such as the demo's runs once), each computing on one thread (tests/conftest.py); 0 runs the
# tests in this process, in order.
# It ends with the 15 slowest tests (--durations). `make test-quick` leaves out those marked `slow`
# too (each over about 20 s alone on 2 cores: end-to-end runs of the demo, compare, compiled models,
# torchrun launches, the memory planner against real runs): the loop while editing; CI runs them all.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -m "not cluster and not learning" -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -m "not cluster and not learning and not slow" -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

test-cluster: $(STAMP)
	$(PY) -m pytest -m cluster $(PYTEST_ARGS)

test-learning: $(STAMP)
	$(PY) -m pytest -m learning -s $(PYTEST_ARGS)

# ruff's lint and format check (CI runs it before the tests); `make format` rewrites in place.
LINTED := proximal tests benchmarks
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

format: $(STAMP)
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

clean:
	rm -rf $(VENV) build *.egg-info
