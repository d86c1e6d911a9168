"""LoRA on the learner (``model.lora``): peft adapters, and what the engines get from them.

The HF model is wrapped with peft *before* ``fully_shard``, so each adapter is sharded with the
decoder layer it belongs to and FSDP2 gathers it with that layer; peft freezes every base
weight, and only the adapters go into the optimizer (``Fsdp2Trainer``). peft is used for the
module surgery and its forward only: merging is done here on gathered CPU tensors, because
peft's ``merge_and_unload`` works on local modules, not on DTensor shards.

After a step the engines get one of two things (:func:`engine_state`):

* the adapters alone (:func:`gather_adapters`), for engines that merge them into their own copy
  of the base weights (the torch engine, ``rollouters.engines.lora_merge``). This is the point
  of LoRA at scale: an update is ``r·(in + out)`` numbers per target, not ``in·out``;
* merged weights under the plain HF names (:func:`merged_state`) for every engine that loads
  HF weights as they are (vLLM in-process or server, SGLang), and for HF exports and
  evaluation by ``from_pretrained``: they need no LoRA support at all.

Both travel in memory over the same broadcast; the format is in ``asyncrl.weights.lora_wire``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from asyncrl.engine_kinds import engine_kind
from asyncrl.weights.lora_wire import A, B, adapter_name, merge

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.config.schema import LoraConfig

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."  # PeftModel → LoraModel → the HF model
_ADAPTER = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.default\.weight$")


def wrap_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> nn.Module:
    """``model`` with LoRA adapters on ``cfg.target_modules`` (peft's default init: ``B = 0``,
    so the wrapped model computes exactly what the base model does: version 0 is unchanged).
    peft raises ``ValueError`` when no module matches the targets. Left in eval mode.

    ``A``'s random init is drawn from ``seed`` in a forked CPU RNG: every rank must build the
    SAME adapters before ``fully_shard`` keeps its slice of them (ranks seed their own RNGs
    differently), and the caller's RNG stream is left as it was. Wrap on CPU, then move."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(model, cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha,
                              target_modules=list(cfg.target_modules), lora_dropout=0.0,
                              bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, peft_cfg)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    logger.info("LoRA r=%d alpha=%g on %s: %d of %d parameters trainable", cfg.rank, cfg.alpha,
                cfg.target_modules, trainable, total)
    return wrapped.eval()


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Refuse targets this module's merge cannot serve, naming the config key, before peft
    builds anything: a non-linear module (peft would put ``lora_embedding_*`` adapters on an
    embedding, which no engine here merges), or a linear layer whose weight is tied to
    another parameter (``lm_head`` of a ``tie_word_embeddings`` model: merging ``W + B·A``
    into one name would untie it, and the engines' copy of the shared weight would diverge
    from the learner's)."""
    names = set(targets)
    shared = _shared_parameter_ids(model)
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if leaf not in names:
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"model.lora.target_modules: {path!r} is "
                             f"{_article(type(module).__name__)}, not a linear layer; LoRA "
                             f"adapters are built for linear layers only")
        if id(module.weight) in shared:
            raise ValueError(f"model.lora.target_modules: {path!r} shares its weight with "
                             f"another module (tie_word_embeddings); an adapter on it would "
                             f"untie the weights. Target the decoder's linear layers, or "
                             f"use an untied model")


def _article(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one module (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {pid for pid, count in owners.items() if count > 1}


def hf_model(model: nn.Module) -> nn.Module:
    """The HF model inside a peft wrapper (the model itself when not wrapped): what
    ``fully_shard`` and ``save_pretrained`` work on."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _adapter_part(name: str) -> tuple[str, str] | None:
    """``(HF weight name, "lora_A" | "lora_B")`` of a peft adapter parameter, else None.
    Parameter names inside an activation-checkpointed layer carry the wrapper's prefix, which
    state dicts strip: it is stripped here too."""
    match = _ADAPTER.match(name.removeprefix(PEFT_PREFIX).replace(_CHECKPOINT_PREFIX, ""))
    return (f"{match['module']}.weight", match["part"]) if match else None


def _hf_name(name: str) -> str:
    """The plain HF name of a peft base parameter (``….q_proj.base_layer.weight`` →
    ``….q_proj.weight``)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_state(peft_state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A peft model's state dict as plain HF weights, ``W0 + scale·B·A`` for every target, in
    the base model's order. An empty state (a rank other than 0) stays empty."""
    weights: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in peft_state.items():
        part = _adapter_part(name)
        if part is not None:
            adapters.setdefault(part[0], {})[part[1]] = tensor
        elif ".lora_" in name:
            raise ValueError(f"unsupported LoRA tensor {name!r} (only lora_A/lora_B on "
                             f"linear layers)")
        else:
            weights[_hf_name(name)] = tensor
    for name, parts in adapters.items():
        weights[name] = merge(weights[name], parts[A], scale * parts[B])
    return weights


def gather_adapters(model: nn.Module, scale: float, rank: int) -> dict[str, torch.Tensor]:
    """Every adapter, full and on CPU, named for the wire (``asyncrl.weights.lora_wire``: B already
    multiplied by ``scale``), on rank 0; an empty dict on the others. COLLECTIVE: each
    sharded adapter is all-gathered, in the same order on every rank."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        part = _adapter_part(name)
        if part is None:
            continue
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if rank == 0:
            tensor = full.detach().to("cpu", copy=True)
            out[adapter_name(*part)] = tensor * scale if part[1] == B else tensor
    return out


def sends_adapters(cfg: Config) -> bool:
    """Do this run's engines get adapters (and merge them), rather than merged weights?"""
    return bool(cfg.model.lora.rank) and engine_kind(cfg.rollout.engine).merges_adapters


def engine_state(trainer: Any, cfg: Config, sent: bool = True) -> dict[str, torch.Tensor]:
    """What the engines, and rank 0's evaluation engine (a torch engine), load after a step:
    the adapters (:func:`sends_adapters`) or the full merged HF weights. COLLECTIVE. On rank
    0 only, unless ``sent`` (the state goes to the engines) with ``weights.fanout`` on: then
    on every rank, each of which sends it to its slice of the engines
    (:mod:`asyncrl.weights.senders` says what that costs). A frozen vision tower
    (``model.freeze_vision``) is not sent: the engines hold it already, unchanged since the
    start; the export (not ``sent``) has it."""
    if sends_adapters(cfg):
        return trainer.adapter_state_dict()
    state = trainer.full_state_dict(every_rank=True) if sent and fans_out(cfg) \
        else trainer.full_state_dict()
    return without_frozen_vision(state) if sent and cfg.model.freeze_vision else state


def without_frozen_vision(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` less a VLM's vision tower (:func:`asyncrl.vlm.is_vision_name`)."""
    from asyncrl.vlm import is_vision_name

    return {name: value for name, value in state.items() if not is_vision_name(name)}


def fans_out(cfg: Config) -> bool:
    """Does every learner rank of this process group send the weights (``weights.fanout``)?"""
    import torch.distributed as dist

    from asyncrl.weights.senders import fanout_senders

    world = dist.get_world_size() if dist.is_initialized() else 1
    return fanout_senders(cfg, world) > 1
