"""FSDP2 trainer: an HF causal LM sharded with ``fully_shard``, trained on the configured objective
(``learner.loss``: policy loss, aggregation, KL to a frozen reference; see ``learners.losses``).

Needs the default process group (``learners.dist.init_learner_group``) before construction.
Every public method is COLLECTIVE: all ranks call it, in the same order, or the group hangs.

Gradient scaling (verified by ``tests/unit/test_fsdp2.py``): FSDP2's reduce-scatter AVERAGES
gradients over ranks. Each rank's loss is its weighted sum divided by the GLOBAL unit count
(tokens, samples or groups: the aggregation level), so the global-mean gradient is the SUM of the
ranks' gradients; we multiply the loss by the world size to undo the average. Then W ranks on W
shards of a batch take the same step as one rank on the whole batch, whatever the shards' sizes.

Per step, before the update and without gradients: the proximal logprobs (decoupled PPO) and
the frozen reference's logprobs (``kl_coef > 0``; the reference is sharded like the actor and has
no optimizer). Every step reports the train-vs-rollout mismatch (``mismatch/…``,
``learners.mismatch``) and warns past ``loss.mismatch_warn_abs_logp``.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from asyncrl.config.schema import LearnerConfig
from learners.batching import TrainBatch
from learners.critic import Critic, ValueModel
from learners.dist import resolve_device
from learners.losses.objective import objective
from learners.mismatch import mismatch_metrics, mismatch_sums, reduce_mismatch, warn_if_mismatched

logger = logging.getLogger(__name__)

# Non-weight files copied next to a saved checkpoint so that an engine can load the directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
# Objective stats that are means over tokens: reported as means over the GLOBAL tokens.
_TOKEN_MEANS = ("clip_frac", "is_capped_frac", "kl_ref")


def token_logprobs(model: nn.Module, batch: TrainBatch) -> Tensor:
    """``log p(targets[b, t] | input_ids[b, ≤t])`` as float32 ``[B, T]`` (see the batching shift)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


def shard_model(model: nn.Module, world: int, device_type: str) -> None:
    """``fully_shard`` each decoder layer, then the root (which holds embeddings, norm, head)."""
    mesh = init_device_mesh(device_type, (world,))
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


class Fsdp2Trainer:
    """One learner rank: the sharded model, its AdamW, and the optimizer-step counter."""

    def __init__(self, model_path: str | Path, cfg: LearnerConfig, device: torch.device | str,
                 version: int = 0, dtype: torch.dtype = torch.float32,
                 reference_path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # A string goes through the same rule as init_learner_group ("auto", cuda → rank's GPU).
        self.device = resolve_device(device, self.rank) if isinstance(device, str) else device
        self.model_path = Path(model_path)
        self.version = version  # optimizer steps taken, i.e. the policy version of the weights
        self.model = self._load_sharded(model_path, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        # The frozen reference: the base model (not a resumed checkpoint: pass reference_path).
        self.reference: nn.Module | None = None
        if cfg.loss.kl_coef > 0:
            self.reference = self._load_sharded(reference_path or model_path, dtype)
            self.reference.requires_grad_(False)
        # The critic (GAE only): a value head on a copy of the decoder, sharded the same way.
        self.critic: Critic | None = None
        if cfg.loss.advantage == "gae":
            value_model = ValueModel(model_path, dtype).to(self.device)
            value_model.eval()   # no dropout, like the actor
            shard_model(value_model, self.world, self.device.type)
            self.critic = Critic(value_model, cfg, self.world)
        logger.info("rank %d/%d: %s sharded, %d params, version %d, loss %s/%s/%s, reference %s",
                    self.rank, self.world, type(self.model).__name__,
                    sum(p.numel() for p in self.model.parameters()), version,
                    cfg.loss.policy_loss, cfg.loss.advantage, cfg.loss.aggregation,
                    "yes" if self.reference is not None else "no")

    def _load_sharded(self, path: str | Path, dtype: torch.dtype) -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device)
        # Eval mode = no dropout: on-policy, the importance ratio against the engine must be 1.
        model.eval()
        shard_model(model, self.world, self.device.type)
        return model

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; metrics are global and
        identical on every rank (``learner/step_time_s`` is the slowest rank's)."""
        start = time.perf_counter()
        batch = batch.to(self.device)
        critic_metrics: dict[str, float] = {}
        if self.critic is not None:
            batch, critic_metrics = self.critic.advantages_and_update(batch)
        proximal, ref = self._frozen_logprobs(batch)
        logprobs = token_logprobs(self.model, batch)
        loss_sum, units, stats = objective(self.cfg, batch, logprobs, proximal, ref)
        global_units = units.clone()
        dist.all_reduce(global_units)
        # × world: FSDP2 averages gradients over ranks; we want their sum (module docstring).
        (loss_sum * self.world / global_units.clamp(min=1.0)).backward()
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        metrics = self._global_metrics(loss_sum.detach(), global_units, stats, batch.rewards)
        metrics.update(self._mismatch(logprobs.detach(), batch))
        metrics.update(critic_metrics)
        metrics["learner/grad_norm"] = float(_full(grad_norm))
        metrics["learner/step_time_s"] = self._max_over_ranks(time.perf_counter() - start)
        return metrics

    @torch.no_grad()
    def _frozen_logprobs(self, batch: TrainBatch) -> tuple[Tensor | None, Tensor | None]:
        """Before the update: proximal logprobs under the current weights (decoupled PPO) and
        the reference's logprobs (KL). Collective (FSDP all-gathers) whenever configured."""
        proximal = None
        if self.cfg.loss.policy_loss == "decoupled_ppo":
            proximal = token_logprobs(self.model, batch)
        ref = token_logprobs(self.reference, batch) if self.reference is not None else None
        return proximal, ref

    def _mismatch(self, logprobs: Tensor, batch: TrainBatch) -> dict[str, float]:
        """Global train-vs-rollout mismatch of the pre-update logprobs; warns past the bound."""
        high = self.cfg.loss.clip_eps_high
        sums = mismatch_sums(logprobs, batch.behaviour_logprobs, batch.loss_mask,
                             self.cfg.clip_eps, self.cfg.clip_eps if high is None else high)
        metrics = mismatch_metrics(reduce_mismatch(sums))
        if self.rank == 0:
            warn_if_mismatched(metrics, self.cfg.loss.mismatch_warn_abs_logp)
        return metrics

    def _global_metrics(self, loss_sum: Tensor, global_units: Tensor, stats: dict[str, Tensor],
                        rewards: Tensor) -> dict[str, float]:
        """All-reduce sums once, then divide: token means over global tokens, reward over samples."""
        tokens = stats["tokens"]
        zero = torch.zeros((), device=tokens.device)
        sums = torch.stack([loss_sum.float(), tokens,
                            *(stats.get(k, zero) * tokens for k in _TOKEN_MEANS),
                            rewards.sum().float(), torch.tensor(float(rewards.numel()),
                                                                device=rewards.device)])
        dist.all_reduce(sums)
        values = sums.tolist()
        total_tokens, total_samples = max(values[1], 1.0), max(values[-1], 1.0)
        metrics = {"learner/loss": values[0] / max(float(global_units), 1.0),
                   "learner/tokens": values[1]}
        for i, name in enumerate(_TOKEN_MEANS):
            if name in stats:
                metrics[f"learner/{name}"] = values[2 + i] / total_tokens
        metrics["learner/reward_mean"] = values[-2] / total_samples
        return metrics

    def _max_over_ranks(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())

    def full_state_dict(self) -> dict[str, Tensor]:
        """The full, unsharded weights on CPU, HF parameter names. COLLECTIVE.

        Rank 0 gets every tensor; the other ranks take part in the gathers and get an EMPTY dict
        (``cpu_offload=True`` keeps the gathered tensors on rank 0 only).
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def save_pretrained(self, path: str | Path) -> None:
        """Write an HF ``from_pretrained`` directory (rank 0 writes; all ranks must call).

        Returns on every rank only once the directory is complete (a barrier after the write).
        Tokenizer files found next to the source model are copied too, so engines can load it.
        """
        state = self.full_state_dict()
        if self.rank == 0:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(path, state_dict=state)
            for name in _TOKENIZER_FILES:
                if (self.model_path / name).is_file():
                    shutil.copy2(self.model_path / name, path / name)
            logger.info("saved version %d to %s", self.version, path)
        dist.barrier()


def _full(value: Tensor) -> Tensor:
    """A DTensor's full value (collective), or the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
