# Every target sets itself up: a fresh clone needs only python3 (>= 3.11).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The demo needs the core only (SQLAlchemy, tenacity): no test, lint or broker packages.
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test $(STAMP) -nt pyproject.toml || \
		$(BIN)/python -m pip install -q --disable-pip-version-check -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/consumerdedup demo

# The tests are I/O-bound: 4 workers on 2 cores take the suite from ~31 min to ~13. A test file
# runs on one worker (--dist loadfile), so a module's fixtures (a broker, a worker process)
# start once; TEST_WORKERS=0 runs serially. .ci/run raises PostgreSQL's lock table for this.
TEST_WORKERS ?= 4

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check consumerdedup adapters tests bench examples
	$(BIN)/ruff format --check consumerdedup adapters tests bench examples
	$(BIN)/mypy
	$(BIN)/mypy adapters/__init__.py adapters/rabbitmq adapters/kafka

bench: $(STAMP)
	$(BIN)/python bench/bench_pipeline.py
	$(BIN)/python bench/bench_bulk.py
	$(BIN)/python bench/bench_rabbitmq.py
	$(BIN)/python bench/bench_kafka.py
	$(BIN)/python bench/bench_relay.py
	$(BIN)/python bench/bench_consumer_scale.py
	$(BIN)/python bench/bench_pruner.py
	$(BIN)/python bench/bench_http.py
	$(BIN)/python bench/bench_telemetry.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
