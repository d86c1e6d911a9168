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
no optimizer; with LoRA it is the policy itself with its adapters switched off, since the base
weights never change: no second copy of the model). Every step reports the train-vs-rollout
mismatch (``mismatch/…``, ``learners.mismatch``) and warns past
``loss.mismatch_warn_abs_logp``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from transformers import AutoConfig

from asyncrl.config.schema import LearnerConfig, LoraConfig
from learners.attention import attn_kwargs, resolve_attn_implementation
from learners.batching import TrainBatch
from learners.compile_blocks import CompileCounter, check_compile, compile_block
from learners.critic import Critic, ValueModel
from learners.backends.micro_steps import (
    MicroSteps,
    PlainBackward,
    merge_token_stats,
    save_hf_dir,
)
from asyncrl.devices import resolve_device
from asyncrl.vlm import auto_model_class, freeze_vision, is_vlm
from learners.liger import apply_liger, check_liger
from learners.lr_schedule import LrSchedule
from learners.offload import make_optimizer
from learners.lora import gather_adapters, hf_model, merged_state, wrap_lora
from learners.packing import token_logprobs as packed_or_padded_logprobs
from learners.step_metrics import step_metrics
from learners.vision import check_vlm_learner

logger = logging.getLogger(__name__)


def token_logprobs(model: nn.Module, batch: TrainBatch) -> Tensor:
    """``log p(targets[b, t] | input_ids[b, ≤t])`` as float32 ``[B, T]`` (see the batching shift):
    one padded forward of the whole batch (:func:`learners.packing.token_logprobs`)."""
    return packed_or_padded_logprobs(model, batch, packing=False)


def compute_dtype(cfg: LearnerConfig, device: torch.device) -> torch.dtype:
    """``learner.mixed_precision``: bf16 compute on CUDA by default, fp32 on CPU."""
    if cfg.mixed_precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32


def speed_settings(cfg: LearnerConfig, device: torch.device) -> str:
    """The learner settings that decide its speed and memory, in one line for the startup log:
    on a GPU the first thing to check when the MFU is low is whether they are what was meant."""
    dtype = str(compute_dtype(cfg, device)).removeprefix("torch.")
    chunks = cfg.logprob_chunk_tokens or "off (full logits)"
    return (f"{dtype} compute, micro-batches of {cfg.micro_batch_tokens} tokens "
            f"{'packed' if cfg.packing else 'padded'}, compile "
            f"{cfg.compile_backend if cfg.compile else 'off'}, log-prob chunks {chunks}, "
            f"liger {'on' if cfg.liger else 'off'}, offload {cfg.offload}, activation "
            f"checkpointing {'on' if cfg.activation_checkpointing else 'off'}")


def shard_model(model: nn.Module, world: int, device_type: str,
                param_dtype: torch.dtype = torch.float32, checkpointing: bool = False,
                compile_backend: str | None = None, offload_params: bool = False) -> None:
    """``fully_shard`` each decoder block, then the root (which holds embeddings, norm, head).

    Blocks are found by class, as the model declares them in ``_no_split_modules`` (what
    ``transformers`` itself never splits across devices: ``Qwen2DecoderLayer``, ``GPT2Block``,
    ``LlamaDecoderLayer``...), not by an attribute path, so any HF causal LM shards.
    ``param_dtype`` below fp32 is FSDP2 mixed precision: the sharded fp32 master weights are
    cast when gathered for compute, gradients are reduced in fp32 and AdamW steps in fp32.
    ``checkpointing`` wraps each block first so its activations are recomputed in backward
    (state-dict names are unchanged: torch's state-dict helpers strip the wrapper's prefix).
    ``compile_backend``: each block is then compiled (``learner.compile``,
    :mod:`learners.compile_blocks`), before it is sharded. ``offload_params``
    (``learner.offload = "params"``): FSDP2's ``CPUOffloadPolicy``: the sharded parameters,
    their gradients and the optimizer state live in host memory and AdamW steps on the CPU;
    each block's parameters are copied to the device for its all-gather.
    """
    mesh = init_device_mesh(device_type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload_params \
        else OffloadPolicy()
    for name in decoder_blocks(model):
        block = model.get_submodule(name)
        if checkpointing:
            parent, _, attr = name.rpartition(".")
            block = checkpoint_wrapper(block)
            setattr(model.get_submodule(parent), attr, block)
        if compile_backend is not None:
            compile_block(block, compile_backend)
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)


def _compile_backend(cfg: LearnerConfig) -> str | None:
    """``learner.compile_backend`` when ``learner.compile`` is on, else None."""
    return cfg.compile_backend if cfg.compile else None


def decoder_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's decoder blocks: the modules whose class is one of its
    ``_no_split_modules`` (outermost only). Raises naming ``learner.backend`` if there are
    none, since FSDP2 would then gather the whole model at once."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    names: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(
                name.startswith(outer + ".") for outer in names):
            names.append(name)
    if not names:
        raise ValueError(
            f"learner.backend = \"fsdp2\" cannot shard {type(model).__name__}: it declares no "
            f"decoder block class in _no_split_modules ({sorted(classes) or 'none'}) that "
            "occurs in the model; use learner.backend = \"deepspeed\", which needs none")
    return names


class Fsdp2Trainer:
    """One learner rank: the sharded model, its AdamW, and the optimizer-step counter."""

    # KL reference = this model with its LoRA adapters off (peft's ``disable_adapter``).
    reference_is_base = False

    def __init__(self, model_path: str | Path, cfg: LearnerConfig, device: torch.device | str,
                 version: int = 0, dtype: torch.dtype = torch.float32,
                 reference_path: str | Path | None = None,
                 lora: LoraConfig | None = None, attn_implementation: str = "auto",
                 temperature: float = 1.0, freeze_vision: bool = True) -> None:
        self.cfg = cfg
        self.freeze_vision = freeze_vision   # model.freeze_vision: a VLM's tower not trained
        self.lora = lora if lora is not None and lora.rank else None
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # A string goes through the same rule as init_learner_group ("auto", cuda → rank's GPU).
        self.device = resolve_device(device, self.rank) if isinstance(device, str) else device
        self.model_path = Path(model_path)
        self.version = version  # optimizer steps taken, i.e. the policy version of the weights
        if cfg.liger:
            check_liger(self.device)   # before any model is loaded
        if cfg.compile:
            check_compile()
        # model.attn_implementation, resolved once for the actor, the reference and the critic.
        self.attn = resolve_attn_implementation(attn_implementation, self.device,
                                                AutoConfig.from_pretrained(model_path))
        self.model = self._load_sharded(model_path, dtype, self.lora)
        # With LoRA only the adapters train: the frozen base has no optimizer state at all.
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(trainable, cfg)
        # The rate follows the version, which a checkpoint restores: resumed runs continue it.
        self.lr_schedule = LrSchedule.from_config(cfg)
        # The frozen reference: the base model (not a resumed checkpoint: pass reference_path).
        # Under LoRA the base weights ARE that model (frozen, never stepped): the policy with
        # its adapters off is the reference, at no memory and no extra all-gathers of its own.
        self.reference: nn.Module | None = None
        self.reference_is_base = (cfg.loss.kl_coef > 0 and self.lora is not None
                                  and reference_path is None)
        if cfg.loss.kl_coef > 0 and not self.reference_is_base:
            self.reference = self._load_sharded(reference_path or model_path, dtype)
            self.reference.requires_grad_(False)
        # The critic (GAE only): a value head on a copy of the decoder, sharded the same way.
        self.critic: Critic | None = None
        if cfg.loss.advantage == "gae":
            value_model = ValueModel(model_path, dtype, self.attn).to(self.device)
            if cfg.liger:
                apply_liger(value_model.model)
            value_model.eval()   # no dropout, like the actor
            shard_model(value_model, self.world, self.device.type,
                        compute_dtype(cfg, self.device), cfg.activation_checkpointing,
                        _compile_backend(cfg), cfg.offload == "params")
            self.critic = Critic(value_model, cfg, self.world)
        self.steps = MicroSteps(cfg, self.device, self.model, PlainBackward(self.model),
                                self.reference, self.reference_is_base, temperature)
        self.compiles = CompileCounter() if cfg.compile else None
        logger.info("rank %d/%d: %s sharded, %d params (%d trainable), version %d, "
                    "attention %s, loss %s/%s/%s, reference %s", self.rank, self.world,
                    type(self.model).__name__, sum(p.numel() for p in self.model.parameters()),
                    sum(p.numel() for p in self.model.parameters() if p.requires_grad), version,
                    self.attn, cfg.loss.policy_loss, cfg.loss.advantage, cfg.loss.aggregation,
                    "a copy" if self.reference is not None
                    else "the base (adapters off)" if self.reference_is_base else "no")
        logger.info("rank %d/%d: %s", self.rank, self.world, speed_settings(cfg, self.device))

    def _load_sharded(self, path: str | Path, dtype: torch.dtype,
                      lora: LoraConfig | None = None) -> nn.Module:
        """The HF model at ``path``, LoRA-wrapped when ``lora`` is given (before sharding, so
        each adapter is sharded with its layer), with its HF model ``fully_shard``-ed. The
        adapters are made on CPU from a fixed seed, identical on every rank."""
        model = auto_model_class(path).from_pretrained(path, dtype=dtype,
                                                       **attn_kwargs(self.attn))
        # Eval mode = no dropout: on-policy, the importance ratio against the engine must be 1.
        model.eval()
        if is_vlm(model):
            check_vlm_learner(self.cfg)
            if self.freeze_vision:   # before the optimizer is built: the tower gets no state
                logger.info("vision tower frozen (model.freeze_vision): %d parameters",
                            freeze_vision(model))
        if self.cfg.liger:
            apply_liger(model)
        if lora is not None:
            model = wrap_lora(model, lora)
        model = model.to(self.device)
        shard_model(hf_model(model), self.world, self.device.type,
                    compute_dtype(self.cfg, self.device), self.cfg.activation_checkpointing,
                    _compile_backend(self.cfg), self.cfg.offload == "params")
        return model

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; metrics are global and
        identical on every rank (``timing/train_step`` is the slowest rank's).

        The share runs as micro-batches with gradients accumulated, each loss divided by the
        step's GLOBAL unit count (:mod:`learners.backends.micro_steps`)."""
        start = time.perf_counter()
        batch = batch.to(self.device)
        critic_metrics: dict[str, float] = {}
        if self.critic is not None:
            batch, critic_metrics = self.critic.advantages_and_update(batch, self.version)
        global_units = self.steps.global_units(batch)
        # × world: FSDP2 averages gradients over ranks; we want their sum (module docstring).
        scale = self.world / global_units.clamp(min=1.0)
        loss_sum, stats, mismatch = self.steps.accumulate(batch, scale)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.lr_schedule.apply(self.optimizer, self.version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        metrics = step_metrics(loss_sum, global_units, merge_token_stats(stats), batch)
        metrics.update(self.steps.mismatch_metrics(mismatch))
        metrics.update(critic_metrics)
        metrics["actor/grad_norm"] = float(_full(grad_norm))
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        if self.compiles is not None:   # graphs compiled during this step (0 once warm)
            metrics["perf/compiles"] = self.steps.max_over_ranks(float(self.compiles.take()))
        metrics.update(self.steps.timing_metrics(batch, time.perf_counter() - start))
        return metrics

    def full_state_dict(self, every_rank: bool = False) -> dict[str, Tensor]:
        """The full, unsharded weights on CPU, HF parameter names. COLLECTIVE.

        Rank 0 gets every tensor; the other ranks take part in the gathers and get an EMPTY dict
        (``cpu_offload=True`` keeps the gathered tensors on rank 0 only). ``every_rank``
        (``weights.fanout``): every rank gets them all, each tensor all-gathered and moved to
        host memory one at a time, so the device holds one full tensor at most, and each rank
        holds the model once in host memory. With LoRA these are the merged weights
        ``W0 + (alpha/r)·B·A`` under the plain HF names, so every consumer (engines,
        ``save_pretrained``, evaluation) sees an ordinary model.
        """
        if every_rank:
            sharded = get_model_state_dict(self.model, options=StateDictOptions())
            state = {name: _on_host(value) for name, value in sharded.items()}
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(self.model, options=options)
        return merged_state(state, self.lora.scale) if self.lora is not None else state

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """LoRA only: the adapters alone, as engines that merge them receive them
        (``asyncrl.weights.lora_wire``), on rank 0; an empty dict on the others. COLLECTIVE."""
        if self.lora is None:
            raise RuntimeError("adapter_state_dict needs model.lora.rank > 0")
        return gather_adapters(self.model, self.lora.scale, self.rank)

    def save_pretrained(self, path: str | Path,
                        state: dict[str, Tensor] | None = None) -> None:
        """Write an HF ``from_pretrained`` directory (rank 0 writes; all ranks must call).

        Returns on every rank only once the directory is complete (a barrier after the write).
        Tokenizer files found next to the source model are copied too, so engines can load it.
        ``state``: :meth:`full_state_dict` of this version if the caller already gathered it
        (the end of a run sends the same weights to the engines): not gathered twice.
        """
        if state is None:
            state = self.full_state_dict()
        save_hf_dir(self.model, state, self.model_path, path, self.version)


def _on_host(value: Tensor) -> Tensor:
    """A state-dict value, full and copied to host memory: a DTensor is all-gathered over its
    mesh's device (from host memory first if ``learner.offload`` keeps it there), as torch's
    own full state dict does. COLLECTIVE for a DTensor."""
    mesh = getattr(value, "device_mesh", None)
    if mesh is not None and value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    return _full(value).detach().to("cpu", copy=True)


def _full(value: Tensor) -> Tensor:
    """A DTensor's full value (collective), or the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
