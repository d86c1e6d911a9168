"""Learner checkpoints: model + optimizer state, and a small ``meta.json`` beside it.

Layout under the checkpoint directory (``<run dir>/<checkpoint.dir>``)::

    step_<V>/            one complete checkpoint of version V
        *.distcp         FSDP2: the DCP shards (every rank writes its own)
        .metadata        FSDP2: DCP's index
        deepspeed/       DeepSpeed: ``engine.save_checkpoint`` (model states, and one
                         ZeRO-partitioned optimizer file per rank)
        meta.json        version, time, config hash, format, per-rank RNG states, counters,
                         the LoRA setting it was trained with
    step_<V>.tmp/        a checkpoint being written: never read, removed by the next save
    superseded-<time>/   checkpoints of later versions than a learner started from, moved
                         aside by it (never read, never pruned)

A checkpoint is written to ``step_<V>.tmp`` and renamed to ``step_<V>`` only once complete, so
a learner killed mid-save leaves the previous checkpoint as the latest. The model/optimizer part
is DCP (resharding: any world size may load it) unless the backend saves its own
(:class:`~learners.backends.base.NativeCheckpoint`: DeepSpeed, whose partitioned optimizer state
only it can write; it loads at the same world size). ``meta.json`` records which (``format``).

A learner that starts from version V (a fresh start: 0) moves the directory's checkpoints of
later versions to ``superseded-<time>/``: they are another line of training (``--resume`` of
an earlier checkpoint, a fresh start with ``checkpoint.resume = false``). Left in place, the
newest ``keep`` would have been theirs, so pruning removed the new line's checkpoints as they
were saved, and a restarted learner resumed the old line.

Where each part of the async state lives (issue 5, item 5):

- model, optimizer: here. RNG (torch, CUDA, ``random``; per rank): here.
- learner version V: here (``meta.json``), and published in the buffer.
- data position: ``counters.groups_consumed`` (= V × groups_per_step) here; the buffer is FIFO,
  so where to read next is simply its head. Groups consumed by steps after V (lost with the
  learner) were acked and are not trained again.
- gate counters (``accepted``, ``consumed``, ``in_flight``) and unacked groups: durable in the
  buffer (Redis; the ZMQ broker with ``buffer.zmq.spill_path``), which outlives the learner;
  unacked groups are redelivered after ``buffer.reclaim_idle_s``. A buffer that did NOT
  outlive it (a broker without spill restarted, a Redis namespace reset) is seeded from here at
  resume (``ControlPlane.restore_progress(V, groups_consumed)``, ``learners.lifecycle.resume``):
  its version becomes V and ``accepted``/``consumed`` count the V steps' groups, so versions
  keep increasing from V and the gate admits exactly what it would have. Unacked groups of a
  buffer that lost its state are gone with it (never in a checkpoint: they are rollout output).

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

from learners.backends.base import NativeCheckpoint
from learners.export_dir import swap_in

logger = logging.getLogger(__name__)

META = "meta.json"
DCP = "dcp"
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
    format: str = DCP  # how model and optimizer are stored: DCP, or the backend's own
    lora: dict[str, Any] = field(default_factory=dict)  # its model.lora ({}: not recorded)


def lora_record(lora: Any) -> dict[str, Any]:
    """The part of ``model.lora`` that shapes the saved state and its meaning: off, or the
    rank, scale numerator and targets (a different rank or target set is a different set of
    tensors; a different alpha re-scales every adapter already trained)."""
    if not lora.rank:
        return {"rank": 0}
    return {"rank": lora.rank, "alpha": lora.alpha,
            "target_modules": sorted(lora.target_modules)}


def _check_lora(path: Path, saved: dict[str, Any], wanted: dict[str, Any] | None) -> None:
    """Refuse a resume under another LoRA setting, naming it, before any state is read (DCP
    would otherwise fail on mismatched keys, or silently re-scale the adapters)."""
    if wanted is None or not saved or saved == wanted:
        return
    raise ValueError(f"checkpoint {path} was trained with model.lora = {saved}; this run "
                     f"has {wanted}. Resume with the same model.lora, or start a new run "
                     f"(model.path) from the checkpoint's merged HF export")


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
    # torch.distributed.checkpoint is imported where it is used (~0.7 s): the launcher reads
    # meta.json through this module, and a learner that never checkpoints need not pay it.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state: dict[str, Any] = {}
    for name, (module, optimizer) in _stateful(trainer).items():
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state[f"{name}_model"], state[f"{name}_optim"] = model_sd, optim_sd
    return state


def state_format(trainer: Any) -> str:
    """How ``trainer``'s model and optimizer are stored: its own format, or DCP."""
    return trainer.checkpoint_format if isinstance(trainer, NativeCheckpoint) else DCP


def _write_state(trainer: Any, path: Path) -> None:
    if isinstance(trainer, NativeCheckpoint):
        trainer.save_training_state(path)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(_sharded_state(trainer), checkpoint_id=str(path))


def _read_state(trainer: Any, path: Path, meta: CheckpointMeta) -> None:
    fmt = state_format(trainer)
    if meta.format != fmt:
        raise ValueError(f"checkpoint {path} holds {meta.format!r} state; this learner backend "
                         f"reads {fmt!r} (resume with the learner.backend that wrote it)")
    if isinstance(trainer, NativeCheckpoint):
        world = dist.get_world_size() if dist.is_initialized() else 1
        if meta.world != world:
            raise ValueError(f"checkpoint {path} was written by {meta.world} ranks; a "
                             f"{fmt!r} checkpoint resumes with as many (this learner has "
                             f"{world})")
        trainer.load_training_state(path)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _sharded_state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    for name, (module, optimizer) in _stateful(trainer).items():
        set_state_dict(module, optimizer, model_state_dict=state[f"{name}_model"],
                       optim_state_dict=state[f"{name}_optim"])


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
         counters: dict[str, Any] | None = None, lora: dict[str, Any] | None = None) -> Path:
    """Write ``step_<V>`` for the trainer's version V atomically; keep the ``keep`` newest.

    COLLECTIVE. Returns the checkpoint's path on every rank once it is complete."""
    directory = Path(directory)
    final = directory / f"step_{trainer.version}"
    tmp = directory / f"step_{trainer.version}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save of a killed learner
        tmp.mkdir(parents=True)
    _barrier()
    _write_state(trainer, tmp)
    rng = _gather_rng()  # after the state, so that all ranks have written their shards
    if _rank() == 0:
        meta = CheckpointMeta(trainer.version, time.time(), cfg_hash, len(rng), rng,
                              counters or {}, state_format(trainer), lora or {})
        (tmp / META).write_text(json.dumps(asdict(meta)))
        _swap_in(tmp, final)
        _prune(directory, keep)
        logger.info("checkpoint of version %d saved to %s", trainer.version, final)
    _barrier()
    return final


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``. A checkpoint already there (a copied-in
    one of the same version) goes to ``step_<V>.old`` and is removed only once the new one
    is in place (:func:`~learners.export_dir.swap_in`): killed in between, the previous
    version is the latest."""
    swap_in(tmp, final, final.with_name(f"{final.name}.old"))


def set_aside_after(directory: Path, version: int) -> Path | None:
    """Move the checkpoints of versions after ``version`` (all of them for -1) into a new
    ``superseded-<time>/`` in ``directory``; returns it, None when there were none.

    Why: a learner that starts from ``version`` trains another line from there. The later
    checkpoints are the abandoned line's: kept, they were what a restart resumed, and the
    newest ``keep`` that pruning spares. They are moved, not removed (they may be wanted)."""
    later = [path for v, path in step_dirs(Path(directory)) if v > version]
    if not later:
        return None
    name = f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = Path(directory) / name, 1
    while aside.exists():  # two starts within a second
        n += 1
        aside = Path(directory) / f"{name}.{n}"
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
    logger.warning("%s: %s of later versions than this learner starts from (%d) moved to %s "
                   "(another line of training: not resumed from, not pruned)", directory,
                   ", ".join(p.name for p in later), max(version, 0), aside)
    return aside


def _prune(directory: Path, keep: int) -> None:
    for _, path in step_dirs(directory)[:-keep]:
        shutil.rmtree(path)
        logger.info("removed old checkpoint %s", path)


def load(trainer: Any, path: Path, lora: dict[str, Any] | None = None) -> CheckpointMeta:
    """Restore model, optimizer, version and this rank's RNG from ``path``. COLLECTIVE.

    A DCP checkpoint written by a different number of ranks loads too (DCP reshards); each rank
    then takes the RNG state of rank ``rank mod saved world``. A checkpoint of another format
    than the trainer's (e.g. DeepSpeed's, into FSDP2), or trained under another ``lora``
    (:func:`lora_record`; None skips that check), is refused before any collective."""
    path = Path(path)
    meta = read_meta(path)
    _check_lora(path, meta.lora, lora)
    _read_state(trainer, path, meta)
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
        if not (path / META).is_file():  # a config error: one line, not a traceback
            from asyncrl.config import ConfigError

            raise ConfigError(f"checkpoint.path (--resume): {path} is not a checkpoint (no "
                              f"{META}); give a checkpoints/step_<V> directory")
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
        self.lora = lora_record(cfg.model.lora)
        self.saved_version = -1

    def resume(self, trainer: Any) -> CheckpointMeta | None:
        """Load :func:`resume_point`'s checkpoint into ``trainer``; None on a fresh start.
        The directory's checkpoints of later versions are moved aside (:func:`set_aside_after`)."""
        path = resume_point(self.cfg, self.run_dir)
        if path is None:
            self._set_aside_after(-1)
            return None
        meta = load(trainer, path, self.lora)
        self._set_aside_after(meta.version)
        if meta.config_hash and meta.config_hash != self.hash:
            logger.warning("checkpoint %s was written under a different model/learner config "
                           "(hash %s, now %s)", path, meta.config_hash, self.hash)
        # Saved here only when it is this run's own: resumed from elsewhere (``--resume`` of
        # another run's checkpoint), a run that trains no step (total_steps reached) saves
        # its end as a checkpoint of its own; it used to update the counters of
        # ``checkpoints/step_<V>`` here, which did not exist (FileNotFoundError on rank 0).
        own = self.directory / f"step_{meta.version}"
        if own.exists() and own.resolve() == Path(path).resolve():
            self.saved_version = meta.version
        logger.info("resuming at version %d from %s", meta.version, path)
        return meta

    def _set_aside_after(self, version: int) -> None:
        """COLLECTIVE: rank 0 moves, the others wait (they save into the same directory)."""
        if _rank() == 0:
            set_aside_after(self.directory, version)
        _barrier()

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
             counters=counters, lora=self.lora)
        self.saved_version = trainer.version


def _update_counters(path: Path, counters: dict[str, Any]) -> None:
    """Merge ``counters`` into a saved checkpoint's ``meta.json`` (atomic replace)."""
    meta = read_meta(path)
    meta.counters.update(counters)
    tmp = path / f"{META}.tmp"
    tmp.write_text(json.dumps(asdict(meta)))
    tmp.replace(path / META)
