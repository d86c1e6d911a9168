"""``learner.offload = "optimizer"``: AdamW whose state lives in host memory.

AdamW keeps two fp32 moments per parameter: 8 bytes a parameter, as much as the fp32 weights
and gradients together. Here they stay on the host and come to the device one parameter at a
time during the step (moments to the device, that parameter's update, moments back), so the
device holds the weights, the gradients and ONE parameter's moments. The weights and gradients
stay on the device (``learner.offload = "params"`` moves those too: FSDP2's
``CPUOffloadPolicy``). The moments are the same DTensors FSDP2's CPU offload makes (host-local
shards of the device mesh), so DCP checkpoints them as it does those. The cost: the moments
cross the host link twice per step.

The update is torch's AdamW itself, run on one parameter at a time: the same arithmetic as
one step over all of them (``tests/unit/test_fsdp2_offload.py``).

:func:`make_optimizer` is the one place that picks the optimizer from ``learner.offload``, for
the actor and the GAE critic alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from asyncrl.config.schema import LearnerConfig


def make_optimizer(params: Iterable[Tensor], cfg: LearnerConfig,
                   lr: float | None = None) -> torch.optim.Optimizer:
    """AdamW over ``params`` with the learner's weight decay, its moments on the host with ``learner.offload = "optimizer"``. ``lr``: the peak rate if not
    ``learner.lr`` (the critic's); the schedule (:mod:`learners.lr_schedule`) sets each
    step's rate anyway."""
    kwargs = {"lr": cfg.lr if lr is None else lr, "weight_decay": cfg.weight_decay}
    if cfg.offload == "optimizer":
        return HostStateAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


class HostStateAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with its per-parameter moments kept on ``host``."""

    def __init__(self, params: Iterable[Tensor], host: str | torch.device = "cpu",
                 **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.host = torch.device(host)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        everything = [group["params"] for group in self.param_groups]
        try:
            for group, params in zip(self.param_groups, everything):
                for param in params:
                    if param.grad is None:
                        continue
                    for other in self.param_groups:   # AdamW's step sees this one alone
                        other["params"] = [param] if other is group else []
                    self._move_moments(param, param.device)
                    super().step()
                    self._move_moments(param, self.host)
        finally:
            for group, params in zip(self.param_groups, everything):
                group["params"] = params
        return loss

    def _move_moments(self, param: Tensor, device: torch.device) -> None:
        """The parameter-shaped state (moments) to ``device``; ``step`` counts stay put."""
        state = self.state.get(param)
        for key, value in (state or {}).items():
            if torch.is_tensor(value) and value.shape == param.shape:
                # Blocking: a host copy read before its transfer ended would be stale.
                state[key] = value.to(device)


__all__ = ["HostStateAdamW", "make_optimizer"]
