# Two entry points (see README): `make figures` (set up + main job) and `make test`.
# `make docs` builds the docs into site/ (strict), `make docs-serve` serves them; `make test` builds them too.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PRESET ?= default
JOBS ?= 2
# worker processes of `make figures` (one single-thread run per core; issue 49)
WORKERS ?= 2
# torch threads per test worker (issue 22: the suite passes at 1 and 2)
TEST_THREADS ?= 1

.PHONY: venv test figures docs docs-serve clean

venv: $(VENV)/.installed

# everything: the tests' and the docs' tools too (it holds what the figures need)
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test,docs]"
	touch $@ $(VENV)/.installed-figures

# what the figures need (the MoE analysis builds HuggingFace models): 1 min instead of ≈1.7 on a fresh clone
$(VENV)/.installed-figures: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[hf]"
	touch $@

test: venv
	$(BIN)/ruff check .
	MPLBACKEND=Agg OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -n $(JOBS) --timeout 900 tests

# mkdocs-material prints a notice about its successor on every build
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

figures: $(VENV)/.installed-figures
	MPLBACKEND=Agg $(BIN)/python -m analyses --preset $(PRESET) --workers $(WORKERS) --out figures

clean:
	rm -rf $(VENV) .pytest_cache site .cache
