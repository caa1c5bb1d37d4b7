# The two commands a newcomer needs: `make run` and `make test`. See README.md.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint pytest chaos soak bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required (found " + sys.version.split()[0] + ")")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	@touch $(STAMP)

## run: serve on 127.0.0.1:8080 (QS_REDIS_URL, else a local durable redis-server, else memory)
run: $(STAMP)
	@deploy/dev-run.sh

## test: lint, type-check, then the whole suite (what .ci/run calls)
test: lint pytest

lint: $(STAMP)
	$(BIN)/ruff check service tests bench
	$(BIN)/ruff format --check service tests bench
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest --ignore=tests/chaos --ignore=tests/cluster --ignore=tests/test_races.py $(PYTEST_ARGS)
	@# The race storm and the cluster tier in fresh processes: after ~1,000 tests in one process the
	@# storm ran its Redis pool dry (open item in the closing note of 2026-12-03).
	@# Exit 5 is "no tests collected": a -k filter in PYTEST_ARGS may select nothing there.
	$(BIN)/pytest tests/test_races.py $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/pytest tests/cluster $(PYTEST_ARGS) || [ $$? -eq 5 ]

## chaos: issue 4's evidence: the model-based test and the fault-injection suite (under 15 min; also run by .ci/run)
chaos: $(STAMP)
	$(BIN)/pytest tests/chaos $(PYTEST_ARGS)

## soak: a bounded soak of one service and its own Redis (SOAK_SECONDS, default 600; SOAK_RATE ops/s, default 200); not in CI
SOAK_SECONDS ?= 600
SOAK_RATE ?= 200
soak: $(STAMP)
	$(BIN)/python -m bench.soak --seconds $(SOAK_SECONDS) --rate $(SOAK_RATE)

## bench: issue 3's benchmarks in one run (about 8 min): one table, and docs/benchmarks.md
bench: $(STAMP)
	@$(BIN)/python -c 'import dbos' 2>/dev/null || $(BIN)/pip install --quiet -e ".[bench]" \
		|| echo "bench: could not install the bench extras (.[bench]); the DBOS peer row says why"
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
