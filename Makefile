# Two commands do all the set-up: `make demo` and `make test`. Both create .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned to the CPU build by the constraints file; vLLM is the [vllm] extra.
	$(BIN)/python -m pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/meridian demo

lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest

bench: install
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .meridian .pytest_cache
