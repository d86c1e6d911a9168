"""Learner checkpoints: sharded DCP of model + optimizer, and a small ``meta.json`` beside it.

Layout under the checkpoint directory (``<run dir>/<checkpoint.dir>``)::

    step_<V>/            one complete checkpoint of version V
        *.distcp         the DCP shards (every rank writes its own)
        .metadata        DCP's index
        meta.json        version, time, config hash, per-rank RNG states, data counters
    step_<V>.tmp/        a checkpoint being written: never read, removed by the next save

A checkpoint is written to ``step_<V>.tmp`` and renamed to ``step_<V>`` only once complete, so
a learner killed mid-save leaves the previous checkpoint as the latest. The version, the buffer's
gate counters and unacked groups live in the buffer itself (``buffers.protocol``); the data
position of a FIFO buffer is the version, so ``meta.json`` only records what the learner owns.

:func:`save` and :func:`load` are COLLECTIVE: every learner rank calls them, in the same order.
The directory must be visible to every rank (one node, or a shared filesystem).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

logger = logging.getLogger(__name__)

META = "meta.json"
_STEP = re.compile(r"^step_(\d+)$")


@dataclass
class CheckpointMeta:
    """What ``meta.json`` holds. ``rng`` has one entry per rank, rank order."""

    version: int
    time: float
    config_hash: str
    world: int
    rng: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)


def config_hash(*sections: Any) -> str:
    """A short hash of the config sections that shape the saved state (model, learner): a
    resume under a different one is allowed (e.g. a new lr) but logged."""
    text = "\n".join(s.model_dump_json() for s in sections)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (``step_<V>`` with a ``meta.json``), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP.match(path.name)
        if match and path.is_dir() and (path / META).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory``; ``.tmp`` (partial) ones are ignored."""
    found = step_dirs(Path(directory))
    return found[-1][1] if found else None


def read_meta(path: Path) -> CheckpointMeta:
    return CheckpointMeta(**json.loads((Path(path) / META).read_text()))


def _stateful(trainer: Any) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """The (module, optimizer) pairs that make up the trainable state: the actor, and the
    critic when GAE trains one. The frozen reference is the base model: not saved."""
    pairs = {"actor": (trainer.model, trainer.optimizer)}
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        pairs["critic"] = (critic.model, critic.optimizer)
    return pairs


def _sharded_state(trainer: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, (module, optimizer) in _stateful(trainer).items():
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state[f"{name}_model"], state[f"{name}_optim"] = model_sd, optim_sd
    return state


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON: torch (CPU, and CUDA when present) and ``random``."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state()),
                             "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _gather_rng() -> list[dict[str, Any]]:
    mine = rng_state()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(trainer: Any, directory: Path, *, keep: int, cfg_hash: str = "",
         counters: dict[str, Any] | None = None) -> Path:
    """Write ``step_<V>`` for the trainer's version V atomically; keep the ``keep`` newest.

    COLLECTIVE. Returns the checkpoint's path on every rank once it is complete."""
    directory = Path(directory)
    final = directory / f"step_{trainer.version}"
    tmp = directory / f"step_{trainer.version}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save of a killed learner
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_sharded_state(trainer), checkpoint_id=str(tmp))
    rng = _gather_rng()  # after dcp.save, so that all ranks have written their shards
    if _rank() == 0:
        meta = CheckpointMeta(trainer.version, time.time(), cfg_hash, len(rng), rng,
                              counters or {})
        (tmp / META).write_text(json.dumps(asdict(meta)))
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same version
        tmp.rename(final)
        _prune(directory, keep)
        logger.info("checkpoint of version %d saved to %s", trainer.version, final)
    _barrier()
    return final


def _prune(directory: Path, keep: int) -> None:
    for _, path in step_dirs(directory)[:-keep]:
        shutil.rmtree(path)
        logger.info("removed old checkpoint %s", path)


def load(trainer: Any, path: Path) -> CheckpointMeta:
    """Restore model, optimizer, version and this rank's RNG from ``path``. COLLECTIVE.

    A checkpoint written by a different number of ranks loads too (DCP reshards); each rank
    then takes the RNG state of rank ``rank mod saved world``."""
    path = Path(path)
    meta = read_meta(path)
    state = _sharded_state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    for name, (module, optimizer) in _stateful(trainer).items():
        set_state_dict(module, optimizer, model_state_dict=state[f"{name}_model"],
                       optim_state_dict=state[f"{name}_optim"])
    trainer.version = meta.version
    set_rng_state(meta.rng[_rank() % len(meta.rng)])
    logger.info("rank %d: loaded checkpoint %s (version %d)", _rank(), path, meta.version)
    return meta


def resume_point(cfg: Any, run_dir: Path) -> Path | None:
    """Where a learner of this run resumes: ``checkpoint.path`` (``--resume PATH``) if given,
    else the latest checkpoint in ``<run_dir>/<checkpoint.dir>`` when ``checkpoint.resume`` is
    on, else None (a fresh start). ``cfg`` is the ``checkpoint`` config section."""
    if cfg.path:
        path = Path(cfg.path)
        if not (path / META).is_file():
            raise FileNotFoundError(f"--resume {path}: not a checkpoint (no {META})")
        return path
    return latest(Path(run_dir) / cfg.dir) if cfg.resume else None


class Checkpointer:
    """The learner's checkpoint policy from ``cfg.checkpoint``: where, when, and what to resume.

    Every method is COLLECTIVE (all ranks call it at the same step)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg.checkpoint
        self.run_dir = Path(cfg.run_dir)
        self.directory = self.run_dir / self.cfg.dir
        self.hash = config_hash(cfg.model, cfg.learner)
        self.saved_version = -1

    def resume(self, trainer: Any) -> CheckpointMeta | None:
        """Load :func:`resume_point`'s checkpoint into ``trainer``; None on a fresh start."""
        path = resume_point(self.cfg, self.run_dir)
        if path is None:
            return None
        meta = load(trainer, path)
        if meta.config_hash and meta.config_hash != self.hash:
            logger.warning("checkpoint %s was written under a different model/learner config "
                           "(hash %s, now %s)", path, meta.config_hash, self.hash)
        self.saved_version = meta.version
        logger.info("resuming at version %d from %s", meta.version, path)
        return meta

    def after_step(self, trainer: Any, counters: dict[str, Any]) -> None:
        """Checkpoint every ``every_steps`` and export HF every ``hf_every_steps``."""
        version = trainer.version
        if self.cfg.every_steps and version % self.cfg.every_steps == 0:
            self.save(trainer, counters)
        if self.cfg.hf_every_steps and version % self.cfg.hf_every_steps == 0:
            trainer.save_pretrained(self.run_dir / "hf" / f"step_{version}")

    def save(self, trainer: Any, counters: dict[str, Any] | None = None) -> None:
        """Checkpoint the current version; if it is already saved, only update its counters
        (the end of a run marks it ``finished``)."""
        if trainer.version == self.saved_version:
            if counters and _rank() == 0:
                _update_counters(self.directory / f"step_{trainer.version}", counters)
            _barrier()
            return
        save(trainer, self.directory, keep=self.cfg.keep, cfg_hash=self.hash,
             counters=counters)
        self.saved_version = trainer.version


def _update_counters(path: Path, counters: dict[str, Any]) -> None:
    """Merge ``counters`` into a saved checkpoint's ``meta.json`` (atomic replace)."""
    meta = read_meta(path)
    meta.counters.update(counters)
    tmp = path / f"{META}.tmp"
    tmp.write_text(json.dumps(asdict(meta)))
    tmp.replace(path / META)
