# Every target creates the virtual environment it needs when it is missing.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
COMPAT_VENV ?= .venv-compat
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-compat test test-compat test-versions test-versions-ci lint format demo bench clean

# Setup says what it does before it does it: a first install downloads and unpacks torch and the
# dev tools for minutes, so pip runs without -q and prints each package as it goes.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || echo "==> setup: creating the virtual environment $(VENV) ($(PYTHON) -m venv)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> setup: installing modelgraft (editable, with the dev extra) into $(VENV), pinned by $(CONSTRAINTS):"
	@sed -e 's/#.*//' -e '/^[[:space:]]*$$/d' $(CONSTRAINTS) | tr '\n' ' ' | fold -s -w 96 | sed 's/^/      /'; echo
	$(PY) -m pip install -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)
	@echo "==> setup: done ($(VENV) is ready)"

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# The same suite on transformers 4.57 (constraints-compat.txt), in its own venv; see docs/compat.md.
setup-compat:
	$(MAKE) setup VENV=$(COMPAT_VENV) CONSTRAINTS=constraints-compat.txt

test-compat:
	$(MAKE) test VENV=$(COMPAT_VENV) CONSTRAINTS=constraints-compat.txt

# The version walk (docs/compat.md): the smoke subset on every transformers release of the declared
# range, each in its own cached venv under .venv-versions/, and the refusal of the older releases.
test-versions: $(STAMP)
	$(PY) tools/version_walk.py

# CI's spread of the walk (the newest and 4.57 run the whole suite in `test` and `test-compat`).
test-versions-ci: $(STAMP)
	$(PY) tools/version_walk.py --ci

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples tools
	$(VENV)/bin/ruff format --check src tests benchmarks examples tools
	$(VENV)/bin/mypy  # strict on src/modelgraft; see [tool.mypy] in pyproject.toml

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks examples tools
	$(VENV)/bin/ruff format src tests benchmarks examples tools

demo: $(STAMP)
	@echo "==> demo: examples/demo.py (the complete qwen2_moe example on a tiny local checkpoint, offline)"
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
	rm -rf $(VENV) $(COMPAT_VENV) .venv-versions .pytest_cache .ruff_cache .bench-cache
