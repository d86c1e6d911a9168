"""Which torch device a process computes on: a learner rank's or a rollout engine's.

torch is imported inside the function, so importing this module costs nothing.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def resolve_device(device: str, rank: int, key: str = "learner.device") -> torch.device:
    """``"auto"`` → CUDA if available, else CPU; a CUDA rank uses GPU ``rank % count``.
    ``key``: the setting ``device`` came from, named when no GPU is there for it (this used to
    fail with ``ZeroDivisionError: integer modulo by zero``, after minutes of restarts)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            from asyncrl.config import ConfigError

            raise ConfigError(f"{key}: 'cuda', but this process sees no CUDA device (torch "
                              f"{torch.__version__}, CUDA_VISIBLE_DEVICES="
                              f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}); set "
                              f"it to 'cpu' or 'auto'")
        return torch.device("cuda", rank % count)
    return torch.device(device)


def release_device_memory(device: torch.device) -> None:
    """Give what this process no longer uses on ``device`` back to the driver, for another
    process on the same GPU (the colocated mode: the engines while the learner's state is in
    host memory, the learner while the engines sleep). It waits for the device's work, drops
    cuBLAS's workspaces, then empties the caching allocator. The workspaces are live blocks
    of that allocator, so ``empty_cache`` alone keeps them: on the first CUDA run (H200) the
    learner still held 65 MiB after its state left, and each sleeping engine 33 MiB. cuBLAS
    allocates them again at its next call. Nothing to do off CUDA."""
    import torch

    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)   # private, since 1.13
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
