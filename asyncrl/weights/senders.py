"""How many learner ranks send each version to the engines: ``weights.fanout`` resolved.

With fan-out (:mod:`asyncrl.weights.fanout`) every learner rank serves a slice of the engines,
so the bandwidth that sends the weights grows with the ranks. The price is memory: every rank,
not rank 0 alone, holds the gathered full weights of a version in host memory (the model in
its training dtype: 4 bytes a parameter in fp32, 28 GB for 7B), and while the previous version
is still being delivered (``weights.overlap``) two of them, as rank 0 always did. Eight ranks
on one node hold eight copies where rank 0 alone held one.

Fan-out is off where it buys nothing or cannot work:

- one learner rank: it is the only sender anyway;
- engines that get LoRA adapters alone (``model.lora.rank > 0`` with an engine that merges
  them): the update is a few MB, gathered on rank 0 only.

Every learner backend gathers the full weights on every rank when asked
(``full_state_dict(every_rank=True)``), so the backend never refuses it.

Torch-free: the config checks and the learner both ask this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.engine_kinds import engine_kind

if TYPE_CHECKING:
    from asyncrl.config import Config


def fanout_refusal(cfg: Config) -> str | None:
    """Why fan-out cannot run with ``cfg`` (a reason naming the keys), or None."""
    if cfg.model.lora.rank and engine_kind(cfg.rollout.engine).merges_adapters:
        return (f"the engines get LoRA adapters alone (model.lora.rank = {cfg.model.lora.rank} "
                f"with rollout.engine = {cfg.rollout.engine!r}): a few MB gathered on rank 0, "
                "nothing to fan out")
    return None


def fanout_senders(cfg: Config, world: int) -> int:
    """Learner ranks that send each version: ``world`` with fan-out on, else 1 (rank 0).
    ``weights.fanout = "auto"``: on when ``world > 1`` and :func:`fanout_refusal` has no
    reason; ``true``: on (the config refused it already where it cannot run)."""
    if world <= 1 or cfg.weights.fanout is False:
        return 1
    if cfg.weights.fanout == "auto" and fanout_refusal(cfg) is not None:
        return 1
    return world
