"""``asyncrl eval --checkpoint``: the periodic validation, alone, on saved weights.

Loading a learner checkpoint needs the learners' code (a sharded DCP checkpoint of a LoRA run
is wrapped with peft first, a DeepSpeed one is read by DeepSpeed's tools); scoring needs the
rollouters' (:mod:`rollouters.eval`). This module of the entry layer joins the two, so that
neither package imports the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config


def load_policy(cfg: Config, checkpoint: str | Path):
    """``(model, version, model_dir)`` from an HF model directory (``final/``, ``hf/step_V``) or
    a learner checkpoint (``checkpoints/step_V``, sharded DCP or DeepSpeed's: loaded into the
    initial model)."""
    import json

    from asyncrl.models import load_causal_lm, prepare_model_dir

    path = Path(checkpoint).expanduser()
    if (path / "config.json").is_file():
        version = int(path.name.rsplit("_", 1)[-1]) if path.name.startswith("step_") else -1
        return load_causal_lm(path, cfg.model.dtype), version, path
    meta_path = path / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    deepspeed = meta.get("format") == "deepspeed"
    if not deepspeed and not (path / ".metadata").is_file():
        from asyncrl.config import ConfigError

        raise ConfigError(f"--checkpoint {path}: neither an HF model directory "
                          "(config.json) nor a learner checkpoint (.metadata)")
    model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
    model = load_causal_lm(model_dir, cfg.model.dtype)
    if deepspeed:   # the optional dependency is needed only for such a checkpoint
        from learners.backends.deepspeed import checkpoint_weights

        model.load_state_dict(checkpoint_weights(path))
    else:
        model = _load_dcp(model, path, cfg.model.lora)
    return model, meta.get("version", -1), model_dir


def _load_dcp(model, path: Path, lora):
    """The actor of a sharded DCP checkpoint, as a plain HF model. A LoRA run
    (``model.lora.rank``) checkpointed the peft-wrapped model: the initial model is wrapped the
    same way, loaded, then merged (peft's ``merge_and_unload``, on local modules)."""
    import torch.distributed.checkpoint as dcp

    if lora.rank:
        from learners.lora import wrap_lora

        model = wrap_lora(model, lora)
    state = {"actor_model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["actor_model"])
    return model.merge_and_unload() if lora.rank else model


def run_eval(cfg: Config, checkpoint: str | Path) -> dict[str, float | int]:
    """`asyncrl eval`: the periodic validation, alone, on the weights at ``checkpoint``."""
    import torch

    from asyncrl.tokens import ModelTokenizer
    from rollouters.engines.torch_engine import TorchEngine
    from rollouters.eval import make_evaluator

    torch.set_num_threads(cfg.rollout.threads)
    model, version, model_dir = load_policy(cfg, checkpoint)
    from asyncrl.devices import resolve_device

    tokens = ModelTokenizer(model_dir)  # loaded once, for the engine's ids and the workflow
    special = tokens.special
    engine = TorchEngine(model, eos_ids=special.eos_ids, pad_id=special.pad_id,
                         version=max(version, 0),
                         device=resolve_device(cfg.eval.device, 0, "eval.device"))
    return {"checkpoint": str(checkpoint), "version": version,
            **make_evaluator(cfg, tokens)(engine)}
