"""Which device a learner rank or a torch engine runs on (``asyncrl.devices.resolve_device``)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.devices import resolve_device


def test_cpu_and_auto_on_a_machine_without_a_gpu() -> None:
    assert resolve_device("cpu", 3) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto", 3) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: 'cuda' is valid")
@pytest.mark.parametrize("key", ["learner.device", "rollout.device"])
def test_cuda_without_a_gpu_names_the_setting(key: str) -> None:
    """Was ``ZeroDivisionError: integer modulo by zero`` (``rank % device_count()``), which a
    rollout fleet restarted for two minutes before giving up."""
    with pytest.raises(ConfigError, match=rf"^{key}: 'cuda', but this process sees no CUDA"):
        resolve_device("cuda", 1, key)
