"""DeepSpeed ZeRO-2/3 trainer (``learner.backend = "deepspeed"``, stage ``learner.zero_stage``).

Same protocol and the SAME objective as the FSDP2 trainer (``learners.backends.base.Trainer``):
both run the micro-batched step of :mod:`learners.backends.micro_steps` (frozen logprobs,
objective, global metrics, mismatch) and write the HF export with its ``save_hf_dir``; this
module owns the model setup, the update and the state-dict gather. Every public method is
COLLECTIVE, as in FSDP2.

Gradient scaling (verified by ``tests/unit/test_deepspeed.py``): ZeRO's gradient reduction
AVERAGES over the data-parallel ranks, exactly like FSDP2's reduce-scatter, so the loss is again
the weighted sum / GLOBAL unit count × world size. Clipping is DeepSpeed's ``gradient_clipping``
(same rule as ``clip_grad_norm_``); ``actor/grad_norm`` is DeepSpeed's pre-clip global norm.

The optimizer is torch's AdamW passed as a client optimizer: DeepSpeed's own CPU Adam needs a
~50 s g++ build on first use. ZeRO still wraps it (flat fp32 partitions per rank).

Micro-batching (``learner.micro_batch_tokens``, ``learner.packing``) is FSDP2's loop with
DeepSpeed's accumulation boundary set by hand (:class:`EngineBackward`). Not
supported yet (raises): the GAE critic (it is built on FSDP2). The frozen KL reference is an
unsharded replica on every rank (no optimizer state; under ZeRO-3 this costs one model copy
per rank).

Training checkpoints (``learners.checkpoint``, same layout and ``meta.json`` as FSDP2's) hold
DeepSpeed's own ``engine.save_checkpoint`` under ``step_<V>/deepspeed``: it is what can write
and read the ZeRO-partitioned optimizer state. They resume at the same number of ranks (no
resharding, unlike DCP); ``save_pretrained`` (the HF export) works at any time.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

try:
    import deepspeed
    from deepspeed.runtime.zero import GatheredParameters
except ImportError as exc:  # optional dependency
    raise ImportError("learner.backend = 'deepspeed' needs DeepSpeed: "
                      "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8") from exc

from asyncrl.config.schema import LearnerConfig
from asyncrl.devices import resolve_device
from learners.backends.micro_steps import MicroSteps, merge_token_stats, save_hf_dir
from learners.attention import attn_kwargs, resolve_attn_implementation
from learners.batching import TrainBatch
from learners.lr_schedule import LrSchedule
from learners.step_metrics import step_metrics

logger = logging.getLogger(__name__)

DS_TAG = "deepspeed"  # the sub-directory of step_<V> that holds DeepSpeed's checkpoint


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce op on its first use.

    On the CPU accelerator DeepSpeed builds that op (g++ with the torch headers: 20-80 s on 2
    cores, once per machine, cached in ``~/.cache/torch_extensions``) as it wraps the process
    group, though only ``inference_all_reduce`` (tensor-parallel inference layers) uses it;
    ZeRO's gradients and parameters go through torch.distributed. Marked incompatible, the op
    is not built and the process group is wrapped as it is (DeepSpeed's ``ops`` module keeps
    its probe's result in one dict so that edits to it hold)."""
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def ds_config(cfg: LearnerConfig, zero_overrides: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The DeepSpeed config for one optimizer step per ``train_step`` (no accumulation), fp32.

    ``zero_overrides`` merges into ``zero_optimization`` (tests set
    ``stage3_param_persistence_threshold = 0`` so that a tiny model is really partitioned).
    """
    return {
        "train_micro_batch_size_per_gpu": 1,   # unused: we never give DeepSpeed a dataloader
        "gradient_accumulation_steps": 1,      # >1 would make engine.backward rescale the loss
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, **(zero_overrides or {})},
        "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer
        "steps_per_print": 2**31 - 1,           # our metrics, not DeepSpeed's step log
        "wall_clock_breakdown": False,
    }


class EngineBackward:
    """Micro-batches through the DeepSpeed engine: its forward sets up ZeRO's backward hooks,
    its backward accumulates, and the accumulation boundary is True only for the last micro-
    batch, so ZeRO reduces and steps once."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def policy(self) -> nn.Module:
        return self.engine

    def begin_micro(self, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)

    def backward(self, loss: Tensor) -> None:
        self.engine.backward(loss)


class DeepSpeedTrainer:
    """One learner rank: a DeepSpeed engine around the HF model and torch AdamW."""

    def __init__(self, model_path: str | Path, cfg: LearnerConfig, device: torch.device | str,
                 version: int = 0, dtype: torch.dtype = torch.float32,
                 reference_path: str | Path | None = None,
                 zero_overrides: dict[str, Any] | None = None,
                 attn_implementation: str = "auto", temperature: float = 1.0) -> None:
        if cfg.loss.advantage == "gae":
            raise NotImplementedError("the GAE critic is FSDP2-only; use learner.backend='fsdp2'")
        if cfg.compile:
            raise NotImplementedError("learner.compile is FSDP2-only; use learner.backend='fsdp2'")
        if cfg.liger:
            raise NotImplementedError("learner.liger is FSDP2-only; use learner.backend='fsdp2'")
        if cfg.offload != "none":
            raise NotImplementedError("learner.offload is FSDP2-only; use learner.backend="
                                      "'fsdp2'")
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = resolve_device(device, self.rank) if isinstance(device, str) else device
        self.model_path = Path(model_path)
        self.version = version
        self.attn = resolve_attn_implementation(attn_implementation, self.device,
                                                AutoConfig.from_pretrained(model_path))
        self.engine = self._build_engine(model_path, dtype, zero_overrides)
        # The HF module, for the no-grad forwards (ZeRO-3's gather hooks live on the module) and
        # the HF export.
        self.model: nn.Module = self.engine.module
        self.optimizer = self.engine.optimizer
        self.lr_schedule = LrSchedule.from_config(cfg)   # a function of the version
        self.reference: nn.Module | None = None
        if cfg.loss.kl_coef > 0:
            self.reference = self._load(reference_path or model_path, dtype)
            self.reference.requires_grad_(False)
        self.steps = MicroSteps(cfg, self.device, self.model, EngineBackward(self.engine),
                                self.reference, temperature=temperature)
        logger.info("rank %d/%d: %s under ZeRO-%d, version %d, loss %s/%s/%s, reference %s",
                    self.rank, self.world, type(self.model).__name__, cfg.zero_stage, version,
                    cfg.loss.policy_loss, cfg.loss.advantage, cfg.loss.aggregation,
                    "replicated" if self.reference is not None else "no")

    checkpoint_format = "deepspeed"

    def save_training_state(self, path: Path) -> None:
        """Model and ZeRO optimizer partitions under ``path/deepspeed`` (DeepSpeed's own
        checkpoint; every rank writes its partition). COLLECTIVE. ``learners.checkpoint`` owns
        the directory, ``meta.json`` and the version, so no ``latest`` file is written."""
        self.engine.save_checkpoint(str(path), tag=DS_TAG, save_latest=False)

    def load_training_state(self, path: Path) -> None:
        """Restore :meth:`save_training_state`'s weights and optimizer into this fresh trainer
        (ZeRO-3 can only load into an engine that has not trained yet). COLLECTIVE."""
        loaded, _ = self.engine.load_checkpoint(str(path), tag=DS_TAG,
                                                load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {Path(path) / DS_TAG}")

    def _load(self, path: str | Path, dtype: torch.dtype) -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     **attn_kwargs(self.attn)).to(self.device)
        model.eval()   # no dropout: on-policy, the ratio against the engine must be 1
        return model

    def _build_engine(self, path: str | Path, dtype: torch.dtype,
                      zero_overrides: dict[str, Any] | None) -> Any:
        model = self._load(path, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.cfg.lr,
                                      weight_decay=self.cfg.weight_decay)
        # The process group exists already (learners.dist); DeepSpeed wraps it, but insists on
        # reading LOCAL_RANK from the environment (torchrun sets it; our spawner does not).
        local_rank = self.device.index if self.device.type == "cuda" else self.rank
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        if self.device.type == "cpu":
            skip_shm_comm_op()
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config(self.cfg, zero_overrides),
            dist_init_required=False)
        engine.module.eval()
        return engine

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; metrics are global and
        identical on every rank (``timing/train_step`` is the slowest rank's).

        The share runs as FSDP2's micro-batches through the same loop
        (:class:`~learners.backends.micro_steps.MicroSteps`, :class:`EngineBackward`); the loss
        keeps our GLOBAL normalisation (DeepSpeed's ``gradient_accumulation_steps`` stays 1 and
        never rescales it)."""
        start = time.perf_counter()
        batch = batch.to(self.device)
        global_units = self.steps.global_units(batch)
        # × world: ZeRO averages gradients over ranks; we want their sum (module docstring).
        loss_sum, stats, mismatch = self.steps.accumulate(
            batch, self.world / global_units.clamp(min=1.0))
        self.lr_schedule.apply(self.optimizer, self.version)
        if self.steps.rejected_all:   # ZeRO's gradients are out of reach: step at rate 0
            for group in self.optimizer.param_groups:
                group["lr"] = 0.0
        self.engine.step()   # clip (gradient_clipping), AdamW step, zero the gradients
        self.version += 1
        metrics = step_metrics(loss_sum, global_units, merge_token_stats(stats), batch)
        metrics.update(self.steps.mismatch_metrics(mismatch))
        metrics["actor/grad_norm"] = float(self.engine.get_global_grad_norm())
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics.update(self.steps.timing_metrics(batch, time.perf_counter() - start))
        return metrics

    def full_state_dict(self, every_rank: bool = False) -> dict[str, Tensor]:
        """The full weights on CPU, HF names; rank 0 gets every tensor, the others an EMPTY
        dict, or every rank all of them with ``every_rank`` (``weights.fanout``). COLLECTIVE.
        Gathers one parameter at a time (``GatheredParameters`` all-gathers it on every rank
        either way), so no rank ever holds the whole model twice on its device (under ZeRO-2
        the weights are replicated and the gather is a no-op)."""
        keeps = every_rank or self.rank == 0
        state: dict[str, Tensor] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            with GatheredParameters([param], modifier_rank=None):
                if keeps:
                    state[name] = param.detach().to("cpu", copy=True)
        if keeps:   # persistent buffers are never partitioned
            for name, tensor in self.model.state_dict().items():
                state.setdefault(name, tensor.detach().to("cpu", copy=True))
        return state

    def save_pretrained(self, path: str | Path,
                        state: dict[str, Tensor] | None = None) -> None:
        """Write an HF ``from_pretrained`` directory (rank 0 writes; every rank calls and
        returns once it is complete). ``state``: this version's :meth:`full_state_dict`, if
        the caller already gathered it."""
        save_hf_dir(self.model, self.full_state_dict() if state is None else state,
                    self.model_path, path, self.version)


def checkpoint_weights(path: str | Path) -> dict[str, Tensor]:
    """The full fp32 weights (HF names, CPU) of a ``step_<V>`` written by this backend, read
    without a process group (ZeRO-2 or 3: DeepSpeed merges the ranks' partitions), e.g. for
    ``asyncrl eval --checkpoint``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DS_TAG)


__all__ = ["DS_TAG", "DeepSpeedTrainer", "EngineBackward", "checkpoint_weights", "ds_config"]
