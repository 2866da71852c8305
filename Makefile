# Two commands do everything on a fresh machine: `make demo` and `make test`.
#
# TORCH is the torch requirement installed before the project. The default is the CPU build
# this project is tested with; GPU users pick theirs, e.g.
#   make install TORCH="torch==2.9.1 --index-url https://download.pytorch.org/whl/cu128"
# or TORCH= to keep a torch already in the environment. See docs/quickstart.md.
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.exactga-installed
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1

.PHONY: install demo test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(if $(strip $(TORCH)),$(PY) -m pip install $(TORCH))
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/tune run recipes/full_finetune.py \
		--config configs/tiny/full_single_device.yaml

test: install
	$(PY) -m pytest -n 2 --dist loadgroup

# The tests that launch no `tune run`: every test not marked slow (tests/conftest.py fails one that
# launches it without the mark). See docs/quickstart.md, "Tests".
.PHONY: test-fast
test-fast: install
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs .pytest_cache

# make tensorboard: TensorBoard over every run under outputs/ (TB_LOGDIR=... for another folder),
# served on this machine only, at http://localhost:6006. See docs/quickstart.md.
TB_LOGDIR ?= outputs
.PHONY: tensorboard
tensorboard: install
	$(VENV)/bin/tensorboard --logdir $(TB_LOGDIR) --host localhost

# make gpu-check: the GPU tests and benchmarks in their own virtual environment, and one report
# (docs/gpu_report.md unless GPU_REPORT names another); see docs/quickstart.md, "GPU check".
# GPU_TORCH is installed only when $(PYTHON) has no CUDA torch to reuse; GPU_WHEELS=DIR installs
# offline from a wheel folder; GPU_CHECK_ARGS passes more options (python3 tools/gpu_check.py
# --help), e.g. --rehearse to run each part's no-CUDA path on a machine without a GPU.
GPU_VENV ?= .venv-gpu
GPU_TORCH ?= torch --index-url https://download.pytorch.org/whl/cu128
GPU_WHEELS ?=
GPU_REPORT ?=
GPU_CHECK_ARGS ?=

.PHONY: gpu-check
gpu-check:
	$(PYTHON) tools/gpu_check.py --venv $(GPU_VENV) --torch "$(GPU_TORCH)" \
		$(if $(GPU_REPORT),--report $(GPU_REPORT)) $(if $(GPU_WHEELS),--wheels $(GPU_WHEELS)) \
		--invoked-as "make gpu-check$(if $(GPU_WHEELS), GPU_WHEELS=$(GPU_WHEELS))" $(GPU_CHECK_ARGS)
