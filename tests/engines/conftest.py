"""Shared fixtures for the vLLM engine tests: one tiny model, one engine per session.

Every ``test_vllm*`` test here is marked ``vllm`` and skipped, with the import error as the
reason, only when ``import vllm`` fails (CI installs it). The environment follows the measured
vLLM-on-CPU notes so the engine fits a shared 2-core machine: in-process core, one thread, no
torch.compile.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

logger = logging.getLogger(__name__)

VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
            "TORCH_COMPILE_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
# vLLM's CPU attention needs head size >= 32: hidden 64 over 2 heads (1 KV head).
TINY_SETS = {"num_heads": 2, "num_kv_heads": 1}


def _vllm_import_error() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not installed usably"
        return f"vllm is not importable ({type(exc).__name__}: {exc})"
    return None


def _is_vllm_test(item: pytest.Item) -> bool:
    path = Path(str(item.fspath))
    return path.parent == Path(__file__).parent and path.name.startswith("test_vllm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``test_vllm*`` tests ``vllm``; skip them if vllm does not import (the import,
    seconds long, happens only when such a test was collected)."""
    vllm_items = [item for item in items if _is_vllm_test(item)]
    missing = _vllm_import_error() if vllm_items else None
    for item in vllm_items:
        item.add_marker(pytest.mark.vllm)
        if missing:
            item.add_marker(pytest.mark.skip(reason=missing))


@contextmanager
def restored_env(*keys: str) -> Iterator[None]:
    """Environment variables ``keys`` as they were (set or not) once the block ends, whatever
    it or an engine it starts sets."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def vllm_env() -> Iterator[dict[str, str]]:
    """The test environment for vLLM, in this process and for subprocesses."""
    with restored_env(*VLLM_ENV):
        os.environ.update(VLLM_ENV)
        yield dict(VLLM_ENV)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.config.schema import ModelConfig, TinyModelConfig
    from asyncrl.models import prepare_model_dir

    model_cfg = ModelConfig(tiny=TinyModelConfig(**TINY_SETS))
    return prepare_model_dir(model_cfg, tmp_path_factory.mktemp("vllm-run"), seed=0)


@pytest.fixture(scope="module")
def vllm_engine(vllm_env: dict[str, str], tiny_model_dir: Path) -> Iterator[object]:
    """One in-process vLLM engine per module (start costs seconds). Not per session: the
    engine holds torch.distributed's default group in this process until it is closed, and
    later tests (learners) start groups of their own."""
    yield from started_engine(tiny_model_dir, "vLLM engine")


def started_engine(model_dir: Path, label: str) -> Iterator[object]:
    """An in-process vLLM engine on ``model_dir`` for a module fixture to yield from: its
    start time logged, closed after."""
    import time

    import torch

    from asyncrl.models import EOS_ID
    from rollouters.engines.vllm_engine import VLLMEngine, VLLMOptions

    torch.set_num_threads(1)
    start = time.perf_counter()
    engine = VLLMEngine(model_dir, VLLMOptions(eos_ids=(EOS_ID,), seed=0))
    logger.info("%s started in %.1fs", label, time.perf_counter() - start)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session")
def reference_state(tiny_model_dir: Path) -> dict:
    """The initial weights, as the learner holds them."""
    from asyncrl.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}
