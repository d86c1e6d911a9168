"""The critic for GAE: a value head on a copy of the policy's decoder, with its own AdamW.

``V[b, t]`` is the value of the prefix ``input_ids[b, ≤t]``, i.e. of the state in which the
target at ``t`` is chosen (the batching shift): exactly the ``V_t`` of
:func:`learners.losses.advantages.gae_advantages` over the loss-masked positions. Each step:
values → ``(A, R) = GAE(outcome reward on the last generated token, V)`` → one critic step on
``½ (V − R)²`` (token mean over the GLOBAL batch, scaled by the world size like the policy loss
because FSDP2 averages gradients) → ``A`` replaces the batch's advantages.

The critic's optimizer is the actor's kind (``learner.offload = "optimizer"`` keeps its moments
on the host, :func:`learners.offload.make_optimizer`), and its rate follows the actor's schedule
(:mod:`learners.lr_schedule`) from ``learner.loss.critic_lr`` and
``learner.loss.critic_lr_warmup_steps`` where set. Like the actor's, the rate is a function of
the learner version (one critic step per actor step), so a resumed run continues it.

The head is zero-initialised: V = 0 at first (GAE then reduces to discounted returns), and every
rank starts from the same weights without a shared seed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from asyncrl.config.schema import LearnerConfig
from learners.attention import attn_kwargs
from learners.batching import TrainBatch
from learners.losses.advantages import gae_advantages, outcome_token_rewards
from learners.lr_schedule import LrSchedule
from learners.offload import make_optimizer


class ValueModel(nn.Module):
    """The causal LM's decoder (its ``base_model``: ``.model`` for Llama, ``.transformer``
    for GPT-2) + a scalar head; it declares the LM's decoder blocks, so it shards like the
    actor (:func:`learners.backends.fsdp2.decoder_blocks`)."""

    def __init__(self, path: str | Path, dtype: torch.dtype, attn: str = "sdpa") -> None:
        super().__init__()
        # attn: the learner's resolved model.attn_implementation (learners.attention).
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **attn_kwargs(attn))
        self.model = lm.base_model
        self._no_split_modules = list(lm._no_split_modules or ())
        self.head = nn.Linear(lm.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def critic_schedule(cfg: LearnerConfig) -> LrSchedule:
    """The actor's schedule with the critic's peak rate and, where set, its own warmup."""
    schedule = LrSchedule.from_config(cfg, cfg.loss.critic_lr)
    if cfg.loss.critic_lr_warmup_steps is None:
        return schedule
    return dataclasses.replace(schedule, warmup_steps=cfg.loss.critic_lr_warmup_steps)


class Critic:
    """The sharded :class:`ValueModel` and its optimizer. Every method is COLLECTIVE."""

    def __init__(self, model: ValueModel, cfg: LearnerConfig, world: int) -> None:
        self.model, self.cfg, self.world = model, cfg, world
        self.lr_schedule = critic_schedule(cfg)
        self.optimizer = make_optimizer(model.parameters(), cfg, self.lr_schedule.lr)

    def advantages_and_update(self, batch: TrainBatch, version: int
                              ) -> tuple[TrainBatch, dict[str, float]]:
        """``batch`` with GAE advantages (from the pre-update values), after one critic step
        at the rate of the update made at learner ``version``."""
        values = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        mask = batch.loss_mask
        rewards = outcome_token_rewards(batch.rewards, mask)
        advantages, returns = gae_advantages(rewards, values.detach(), mask,
                                             self.cfg.loss.gae_gamma, self.cfg.loss.gae_lambda)
        m = mask.to(values.dtype)
        loss_sum = (0.5 * (values - returns).square() * m).sum()
        sums = torch.stack([m.sum(), loss_sum.detach(), (values.detach() * m).sum()])
        dist.all_reduce(sums)
        (loss_sum * self.world / sums[0].clamp(min=1.0)).backward()
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        rate = self.lr_schedule.apply(self.optimizer, version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        full_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        count, value_loss, value_sum = sums.tolist()
        metrics = {"critic/loss": value_loss / max(count, 1.0),
                   "critic/values/mean": value_sum / max(count, 1.0),
                   "critic/grad_norm": float(full_norm), "critic/lr": rate}
        return dataclasses.replace(batch, advantages=advantages.to(values.device)), metrics
