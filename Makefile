# Every target creates the virtual environment it needs when it is missing.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
COMPAT_VENV ?= .venv-compat
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-compat test test-compat lint format demo bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# The same suite on transformers 4.57 (constraints-compat.txt), in its own venv; see docs/compat.md.
setup-compat:
	$(MAKE) setup VENV=$(COMPAT_VENV) CONSTRAINTS=constraints-compat.txt

test-compat:
	$(MAKE) test VENV=$(COMPAT_VENV) CONSTRAINTS=constraints-compat.txt

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy  # strict on src/modelgraft; see [tool.mypy] in pyproject.toml

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks examples
	$(VENV)/bin/ruff format src tests benchmarks examples

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/apply_overhead.py
	$(PY) benchmarks/load_conversion.py
	$(PY) benchmarks/load_conversion.py --model qwen2_moe
	$(PY) benchmarks/replay_overhead.py
	$(PY) benchmarks/grafts_speed.py
	$(PY) benchmarks/inspect_speed.py
	$(PY) benchmarks/chunked_loss.py
	$(PY) benchmarks/weight_sync.py
	$(PY) benchmarks/weight_sync.py --model qwen2_moe

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache .ruff_cache .bench-cache
