"""Which device a learner rank or a torch engine runs on (``asyncrl.devices.resolve_device``),
and the memory a colocated process gives back (``release_device_memory``)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.devices import release_device_memory, resolve_device


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_release_gives_back_what_a_matmul_left_allocated() -> None:
    """cuBLAS keeps its workspaces as live blocks of the caching allocator, which
    ``empty_cache`` leaves alone; the release drops them too (the colocated mode's 65 MiB)."""
    device = torch.device("cuda")
    a = torch.randn(512, 512, device=device)
    before = torch.cuda.memory_allocated(device)
    (a @ a).sum().item()
    release_device_memory(device)
    assert torch.cuda.memory_allocated(device) == before
