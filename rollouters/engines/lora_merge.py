"""Engine side of a LoRA adapter update: merge ``W = W0 + B'·A`` from a kept copy of ``W0``.

The learner sends only the adapters (``asyncrl.weights.lora_wire``). The engine keeps the base value
``W0`` of every weight it has merged into, taken the first time an adapter arrives for it, and
computes each merge from that copy: merging into the current weight instead would add every
update on top of the last one. The cost is one copy of the targeted weights (about the model's
linear layers) in the engine's memory, paid once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from asyncrl.weights.lora_wire import check_targets, merge

Adapters = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


class LoraMerger:
    """The base weights an engine has merged adapters into, and the merges themselves."""

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}

    def merged(self, adapters: Adapters, targets: Mapping[str, torch.Tensor],
               replaced: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        """The new value of every weight the update touches, as new tensors (the caller
        assigns them): ``W0 + B'·A`` for each adapter, and ``W0`` again for a weight merged
        before but absent now (an update carries the whole adapter state). ``replaced``: the
        names the same update sends as full weights, which become the new truth (no longer a
        base to restore). Adapters are checked before anything is kept or dropped."""
        check_targets(adapters, targets)
        for name in replaced:
            self._base.pop(name, None)
        out: dict[str, torch.Tensor] = {}
        for name, (lora_a, scaled_b) in adapters.items():
            if name not in self._base:
                self._base[name] = targets[name].detach().clone()
            out[name] = merge(self._base[name], lora_a, scaled_b)
        for name in self._base.keys() - adapters.keys():
            out[name] = self._base[name].clone()
        return out
