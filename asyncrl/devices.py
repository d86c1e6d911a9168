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
