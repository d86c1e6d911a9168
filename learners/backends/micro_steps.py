"""The micro-batched step that the FSDP2 and DeepSpeed backends share.

One optimizer step on a rank's share of the global batch runs as micro-batches of
``learner.micro_batch_tokens`` (packed or padded, ``learners.packing``), each one's forward under
the configured objective and its backward accumulating gradients. Every micro-batch's loss is
divided by the GLOBAL unit count of the whole step (tokens, samples or groups), known before the
first backward, so the sum of the micro-batches' gradients is the gradient of the unbatched step.

The backends differ only in the module whose forward the loss differentiates, in what happens
before a micro-batch (DeepSpeed's accumulation boundary) and in how a backward accumulates: a
:class:`Backward` says that. Everything else here is the same for both, so both compute the
same objective, statistics and train-vs-rollout mismatch. A component rather than a base class:
DeepSpeed builds none of FSDP2's sharded modules, and a subclass would inherit a constructor
it must not call.

Every method that reduces over ranks is COLLECTIVE, as the trainers' are.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncrl.config.schema import LearnerConfig
from learners.batching import TrainBatch
from learners.dist import gather_rows
from learners.export_dir import replace_dir
from learners.flops import ModelFlops, mfu, peak_flops
from learners.fused_logprobs import HeadKernels
from learners.lora import hf_model
from learners.losses.aggregation import aggregation_weights
from learners.losses.objective import objective
from learners.losses.policy import masked_mean
from learners.mismatch import (
    merge_mismatch_sums,
    mismatch_metrics,
    mismatch_sums,
    reduce_mismatch,
    warn_if_all_rejected,
    warn_if_mismatched,
)
from learners.packing import fuses_head, micro_batches, token_logprobs_and_entropy
from learners.packing import token_logprobs as packed_or_padded_logprobs
from learners.routing_replay import RoutingReplay

logger = logging.getLogger(__name__)

# Non-weight files copied next to a saved checkpoint so that an engine can load the directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


class Backward(Protocol):
    """How one backend runs a micro-batch's forward and backward."""

    def policy(self) -> nn.Module:
        """The module whose forward the loss differentiates."""
        ...

    def begin_micro(self, last: bool) -> None:
        """Before a micro-batch's forward; ``last``: its backward ends the accumulation."""
        ...

    def backward(self, loss: Tensor) -> None:
        """Accumulate ``loss``'s gradients."""
        ...


class PlainBackward:
    """``loss.backward()`` through ``model`` itself (FSDP2: its hooks reduce the gradients)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def policy(self) -> nn.Module:
        return self.model

    def begin_micro(self, last: bool) -> None:
        pass

    def backward(self, loss: Tensor) -> None:
        loss.backward()


class MicroSteps:
    """One rank's forwards and backwards of a step, and the step's global reductions.

    ``model``: the policy, run without gradients for the proximal logprobs (decoupled PPO).
    ``reference``: the frozen KL reference, if it is a module of its own; ``reference_is_base``:
    it is ``model`` with its LoRA adapters off (peft's ``disable_adapter``)."""

    def __init__(self, cfg: LearnerConfig, device: torch.device, model: nn.Module,
                 runner: Backward, reference: nn.Module | None = None,
                 reference_is_base: bool = False, temperature: float = 1.0) -> None:
        self.cfg, self.device, self.model, self.runner = cfg, device, model, runner
        # rollout.temperature: every logprob here is of the distribution the engines sampled
        # from, as their behaviour logprobs are (vLLM's processed_logprobs, the torch
        # engine's): at T != 1 the raw logits' ratios would be wrong by the temperature.
        self.temperature = temperature
        self.reference, self.reference_is_base = reference, reference_is_base
        self.rank = dist.get_rank()
        # The policy's forwards (proximal and trained; not a reference model of its own)
        # route as the engine did, micro-batch by micro-batch.
        self.replay = RoutingReplay(model, cfg.packing) if cfg.routing_replay else None
        # learner.compile: the LM head's per-chunk softmax arithmetic is compiled too.
        self.head_kernels = HeadKernels(cfg.compile_backend if cfg.compile else None)
        # perf/mfu: the model's FLOPs per step (learners.flops) against the device's peak.
        self.flops = ModelFlops.of(hf_model(model))
        self.peak = peak_flops(device, cfg.peak_tflops)
        self.fused_head = fuses_head(model, cfg.logprob_chunk_tokens)
        self.rejected_all = False  # the last accumulate's verdict (drop_gradient_if_all_rejected)
        # Decoupled PPO: a forward without gradients for the proximal logprobs.
        self.runs_proximal = cfg.loss.policy_loss == "decoupled_ppo"

    def global_units(self, batch: TrainBatch) -> Tensor:
        """The step's aggregation units over every rank's share (tokens, samples or groups)."""
        _, units = aggregation_weights(batch.loss_mask, batch.group_index,
                                       self.cfg.loss.aggregation, batch.group_tokens)
        units = units.detach().clone()
        dist.all_reduce(units)
        return units

    def accumulate(self, batch: TrainBatch, scale: Tensor
                   ) -> tuple[Tensor, list[dict[str, Tensor]], Tensor | None]:
        """Forward and backward every micro-batch of this rank's share, each loss times
        ``scale``; the summed loss, per-micro statistics and mismatch sums."""
        loss_sum, stats, mismatch = torch.zeros((), device=self.device), [], None
        plan = self.micro_batches(batch)
        for index, micro in enumerate(plan):
            self.runner.begin_micro(index == len(plan) - 1)
            if self.replay is not None:  # through the backward: recomputation routes alike
                self.replay.use(micro)
            # Only the trained tokens' logprobs are used (the loss, KL, mismatch): the LM head
            # skips the rest, in the frozen forwards and the trained one alike.
            trained = micro.loss_mask != 0
            proximal, ref = self.frozen_logprobs(micro, trained)
            logprobs, entropy = token_logprobs_and_entropy(
                self.runner.policy(), micro, self.cfg.packing,
                chunk_tokens=self.cfg.logprob_chunk_tokens,
                entropy_grad=self.cfg.loss.entropy_coeff > 0, temperature=self.temperature,
                head_kernels=self.head_kernels, positions=trained)
            micro_loss, _, micro_stats = objective(self.cfg, micro, logprobs, proximal, ref,
                                                   entropy)
            micro_stats["entropy"] = masked_mean(entropy, micro.loss_mask)
            self.runner.backward(micro_loss * scale)
            if self.replay is not None:  # no other forward replays this micro-batch's routing
                self.replay.use(None)
            loss_sum += micro_loss.detach()
            stats.append(micro_stats)
            mismatch = merge_mismatch_sums(mismatch, self.mismatch_sums(logprobs.detach(), micro))
        self.rejected_all = self.drop_gradient_if_all_rejected(mismatch)
        return loss_sum, stats, mismatch

    def drop_gradient_if_all_rejected(self, mismatch: Tensor | None) -> bool:
        """When the rollout correction rejected every token of the step (on every rank), the
        gradients are zero; dropping them (``None``) makes a torch optimizer skip every
        parameter: no momentum, no weight decay, the step trains nothing (the warning and
        ``mismatch/kept_tokens = 0`` say so). Returns whether it did: DeepSpeed keeps its
        gradients in ZeRO's own buffers, out of reach here, so its backend steps at learning
        rate 0 instead. COLLECTIVE when a correction mask is on."""
        if self.cfg.loss.correction.mask == "none" or mismatch is None:
            return False
        counts = mismatch[[0, 6]].clone()
        dist.all_reduce(counts)
        if counts[0] > 0 and counts[0] == counts[1]:
            for parameter in self.model.parameters():
                parameter.grad = None
            return True
        return False

    def micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """This rank's micro-batches, padded with zero-weight ones to the most any rank has:
        sharded all-gathers need every rank to run the same number of forwards and backwards."""
        plan = micro_batches(batch, self.cfg.micro_batch_tokens, self.cfg.packing)
        count = torch.tensor([len(plan)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return plan + [batch.as_pad()] * (int(count.item()) - len(plan))

    @torch.no_grad()
    def frozen_logprobs(self, batch: TrainBatch, positions: Tensor
                        ) -> tuple[Tensor | None, Tensor | None]:
        """Before the update: proximal logprobs under the current weights (decoupled PPO) and
        the reference's logprobs (KL), at ``positions`` (0 elsewhere). Collective (sharded
        all-gathers) whenever configured."""
        args = (self.cfg.packing, self.cfg.logprob_chunk_tokens, self.temperature,
                self.head_kernels, positions)
        proximal = None
        if self.runs_proximal:
            proximal = packed_or_padded_logprobs(self.model, batch, *args)
        ref = None
        if self.reference is not None:
            ref = packed_or_padded_logprobs(self.reference, batch, *args)
        elif self.reference_is_base:
            with self.model.disable_adapter():
                ref = packed_or_padded_logprobs(self.model, batch, *args)
        return proximal, ref

    def step_flops(self, batch: TrainBatch) -> float:
        """The model FLOPs of this rank's share of a step: its forward and backward, and the
        frozen forwards (proximal, reference) this objective runs."""
        lengths = batch.lengths.tolist()
        head_tokens = int((batch.loss_mask != 0).sum()) if self.fused_head else sum(lengths)
        frozen = int(self.runs_proximal) + int(self.reference is not None
                                               or self.reference_is_base)
        return self.flops.step(lengths, head_tokens, frozen)

    def timing_metrics(self, batch: TrainBatch, seconds: float) -> dict[str, float]:
        """``timing/train_step`` (the slowest rank's ``seconds``), ``perf/tflops`` (the model
        FLOPs of the step per device and second of it) and, where the device's peak is known,
        ``perf/mfu``. COLLECTIVE: one all-gather."""
        rows = gather_rows(torch.tensor([seconds, self.step_flops(batch)], dtype=torch.float64,
                                        device=self.device))
        step_s, flops = float(rows[:, 0].max()), float(rows[:, 1].sum())
        world = rows.shape[0]
        metrics = {"timing/train_step": step_s,
                   "perf/tflops": flops / max(step_s, 1e-9) / world / 1e12}
        share = mfu(flops, step_s, self.peak, world)
        if share is not None:
            metrics["perf/mfu"] = share
        return metrics

    def mismatch_sums(self, logprobs: Tensor, batch: TrainBatch) -> Tensor:
        high = self.cfg.loss.clip_eps_high
        return mismatch_sums(logprobs, batch.behaviour_logprobs, batch.loss_mask,
                             self.cfg.clip_eps, self.cfg.clip_eps if high is None else high,
                             self.cfg.loss.correction, self.cfg.loss.policy_loss)

    def mismatch_metrics(self, sums: Tensor) -> dict[str, float]:
        """Global train-vs-rollout mismatch from this rank's sums; warns past the bound."""
        metrics = mismatch_metrics(reduce_mismatch(sums))
        if self.rank == 0:
            warn_if_mismatched(metrics, self.cfg.loss.mismatch_warn_abs_logp)
            warn_if_all_rejected(metrics)
        return metrics

    def max_over_ranks(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())


def merge_token_stats(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Objective stats of several micro-batches as those of their union: ``tokens`` and
    ``*_sum`` add, ``*_max``/``*_min`` take the extreme, the rest are token means (weighted by
    each part's ``tokens``). A pad micro-batch (no tokens) changes nothing."""
    tokens = torch.stack([p["tokens"] for p in parts])
    merged = {"tokens": tokens.sum()}
    for key in parts[0]:
        values = torch.stack([p[key].float() for p in parts])
        if key.endswith("_sum"):
            merged[key] = values.sum()
        elif key.endswith("_max"):
            merged[key] = values.max()
        elif key.endswith("_min"):
            merged[key] = values.min()
        elif key != "tokens":
            merged[key] = (values * tokens).sum() / tokens.sum().clamp(min=1.0)
    return merged


def save_hf_dir(model: nn.Module, state: dict[str, Tensor], source: Path, path: str | Path,
                version: int) -> None:
    """Write an HF ``from_pretrained`` directory from ``state`` (the full weights, gathered on
    rank 0, which alone writes; every rank calls, and returns once it is complete: a barrier).
    Tokenizer files found next to the source model (``source``) are copied too, so engines
    can load it."""
    if dist.get_rank() == 0:
        def write(directory: Path) -> None:
            # The HF model, not a peft wrapper (which would write the adapters alone): the
            # state is merged, so the directory loads with plain ``from_pretrained``.
            hf_model(model).save_pretrained(directory, state_dict=state)
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, directory / name)

        replace_dir(path, write)   # never half-written (learners.export_dir)
        logger.info("saved version %d to %s", version, path)
    dist.barrier()


__all__ = ["Backward", "MicroSteps", "PlainBackward", "TOKENIZER_FILES", "merge_token_stats",
           "save_hf_dir"]
