# defense-suite: the README's two commands are `make bench` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup bench bench-full test test-explore lint typecheck unit docs clean

setup: $(STAMP)

# torch first, pinned to the CPU build on disk, so nothing pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[all,dev]"
	# compile every numba kernel path once, so first calls load from the cache
	$(BIN)/python -m defenses.jit
	touch $(STAMP)

bench: $(STAMP)
	$(BIN)/defense-suite bench --profile quick

bench-full: $(STAMP)
	$(BIN)/defense-suite bench --profile full

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# the fast tier on TEST_JOBS worker processes (pytest-xdist; a file's tests stay
# together, so its module fixtures are built once): TEST_JOBS=1 runs in one process
TEST_JOBS ?= 2
unit: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist loadfile

test: lint typecheck unit

# nightly-style: every tier, with hypothesis drawing fresh examples (ten times as many)
test-explore: $(STAMP)
	HYPOTHESIS_PROFILE=explore $(BIN)/pytest -q -p no:cacheprovider --runslow

# the API reference from the docstrings (mkdocs.yml), into build/api-site/
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build/api-site
