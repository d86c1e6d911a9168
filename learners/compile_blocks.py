"""``learner.compile``: ``torch.compile`` per decoder block, and the count of compilations.

Each decoder block is compiled on its own before it is sharded (as torchtitan does): FSDP2's
hooks stay outside the compiled graphs, and a block's graph is small and the same for every
layer. Shapes are dynamic from the first call (``dynamic=True``; parameters stay static), so a
new micro-batch length does not recompile: the first micro-batch compiles, and after that
only a new kind of input does (a padded micro-batch after packed ones, the reference's
no-grad forward). :class:`CompileCounter` reports how many graphs were compiled during a step
(``perf/compiles``): 0 once warm; a count that keeps rising means recompiles every step.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def check_compile() -> None:
    """Refuse ``learner.compile = true`` where ``torch.compile`` would silently run eager:
    ``TORCH_COMPILE_DISABLE=1`` in the environment (which vLLM on a CPU wants, and which a
    shell or a launcher may pass on) turns dynamo off for the whole process."""
    import torch._dynamo

    if torch._dynamo.config.disable:
        raise ValueError("learner.compile = true, but torch.compile is disabled in this process "
                         "(TORCH_COMPILE_DISABLE=1 in its environment?): unset it, or set "
                         "learner.compile = false")


def compile_block(block: nn.Module, backend: str) -> None:
    """Compile ``block``'s forward in place (its class, names and state dict unchanged)."""
    block.compile(backend=backend, dynamic=True)


class CompileCounter:
    """Graphs compiled by ``torch.compile`` in this process since the last :meth:`take`."""

    def __init__(self) -> None:
        self.seen = self._total()

    @staticmethod
    def _total() -> int:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["ok"])

    def take(self) -> int:
        total = self._total()
        new, self.seen = total - self.seen, total
        return new


__all__ = ["CompileCounter", "check_compile", "compile_block"]
