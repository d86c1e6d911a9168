"""Training backends, chosen by ``learner.backend`` through :func:`make_trainer`.

Backends are imported lazily: they pull in transformers and torch.distributed, which a process
that only builds batches (or reads this package's names) should not pay for.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from asyncrl.config.schema import LearnerConfig, LoraConfig, SimConfig
    from learners.backends.base import Trainer


def make_trainer(model_path: str | Path, cfg: LearnerConfig, device: torch.device | str,
                 version: int = 0, sim: SimConfig | None = None,
                 lora: LoraConfig | None = None, attn_implementation: str = "auto",
                 temperature: float = 1.0, freeze_vision: bool = True) -> Trainer:
    """Build the backend named by ``cfg.backend`` (needs the learner process group first);
    ``sim`` is the root config's ``[sim]`` section, used by the ``sim`` backend only; ``lora``
    is ``model.lora``, which only FSDP2 supports (the config refuses it with other backends);
    ``attn_implementation`` is ``model.attn_implementation`` (``learners.attention``);
    ``temperature`` is ``rollout.temperature``, which the learner's logprobs divide by;
    ``freeze_vision`` is ``model.freeze_vision`` (a vision-language model, FSDP2)."""
    if cfg.backend == "fsdp2":
        from learners.backends.fsdp2 import Fsdp2Trainer
        return Fsdp2Trainer(model_path, cfg, device, version=version, lora=lora,
                            attn_implementation=attn_implementation, temperature=temperature,
                            freeze_vision=freeze_vision)
    if lora is not None and lora.rank:
        raise ValueError(f"model.lora needs learner.backend = 'fsdp2', not {cfg.backend!r}")
    if cfg.backend == "deepspeed":
        # Optional dependency: importing this module fails with a hint when it is missing.
        from learners.backends.deepspeed import DeepSpeedTrainer
        return DeepSpeedTrainer(model_path, cfg, device, version=version,
                                attn_implementation=attn_implementation,
                                temperature=temperature)
    if cfg.backend == "sim":
        from asyncrl.config.schema import SimConfig
        from learners.backends.sim import SimTrainer
        return SimTrainer(model_path, cfg, sim or SimConfig(), version=version)
    raise ValueError(f"unknown learner backend {cfg.backend!r}")


__all__ = ["make_trainer"]
