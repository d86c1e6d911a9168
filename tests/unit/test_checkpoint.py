"""Learner checkpoints: a save/load round trip restores what the next step depends on (weights,
AdamW moments, version, RNG), partial saves are never 'latest', and old ones are pruned."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig
from learners import checkpoint
from learners.batching import collate
from tests.unit.test_fsdp2 import make_groups, tiny_model_dir  # noqa: F401 (fixture)

CFG = LearnerConfig(lr=1e-2, grad_clip=1.0, clip_eps=0.2)
QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"

@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A 1-rank gloo group in this process, torn down after the test."""
    from asyncrl.net import free_port
    from learners.dist import init_learner_group, shutdown_learner_group

    torch.set_num_threads(1)
    init_learner_group(0, 1, master_port=free_port(), timeout_s=60.0)
    try:
        yield
    finally:
        shutdown_learner_group()


def _step(trainer) -> None:
    trainer.train_step(collate(make_groups(), std_norm=True, pad_id=0))


def _optim_tensors(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, optim = get_state_dict(trainer.model, trainer.optimizer)
    return {f"{p}.{k}": _full(v) for p, s in optim["state"].items() for k, v in s.items()}


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


@pytest.mark.usefixtures("one_rank_group")
def test_round_trip_restores_weights_optimizer_version_rng(tiny_model_dir: Path, tmp_path: Path):
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(tiny_model_dir, CFG, "cpu")
    _step(trainer)
    _step(trainer)
    path = checkpoint.save(trainer, tmp_path, keep=2, cfg_hash="abc", counters={"groups": 8})
    assert path == tmp_path / "step_2" and checkpoint.latest(tmp_path) == path
    expected_rng = (torch.rand(4), random.random())
    _step(trainer)  # the step the resumed trainer must reproduce exactly
    expected_weights, expected_optim = trainer.full_state_dict(), _optim_tensors(trainer)

    resumed = Fsdp2Trainer(tiny_model_dir, CFG, "cpu")
    meta = checkpoint.load(resumed, path)
    assert (meta.version, resumed.version, meta.config_hash) == (2, 2, "abc")
    assert meta.counters == {"groups": 8}
    rng = (torch.rand(4), random.random())
    torch.testing.assert_close(rng[0], expected_rng[0])
    assert rng[1] == expected_rng[1]
    _step(resumed)
    assert resumed.version == 3
    for name, tensor in resumed.full_state_dict().items():
        torch.testing.assert_close(tensor, expected_weights[name], rtol=0, atol=1e-6)
    optim = _optim_tensors(resumed)
    assert set(optim) == set(expected_optim)
    for name, tensor in optim.items():
        torch.testing.assert_close(tensor, expected_optim[name], rtol=0, atol=1e-6)


@pytest.mark.usefixtures("one_rank_group")
def test_keep_prunes_and_tmp_is_ignored(tiny_model_dir: Path, tmp_path: Path) -> None:
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(tiny_model_dir, CFG, "cpu")
    for version in (1, 2, 3):
        trainer.version = version
        checkpoint.save(trainer, tmp_path, keep=2)
    assert [v for v, _ in checkpoint.step_dirs(tmp_path)] == [2, 3]
    assert not (tmp_path / "step_1").exists()
    partial = tmp_path / "step_9.tmp"          # a save killed half-way
    partial.mkdir()
    (partial / checkpoint.META).write_text("{}")
    (tmp_path / "step_7").mkdir()              # no meta.json: not complete either
    assert checkpoint.latest(tmp_path) == tmp_path / "step_3"


def test_latest_of_missing_directory_is_none(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "nothing") is None


def test_rng_state_json_round_trip() -> None:
    state = checkpoint.rng_state()
    expected = (torch.rand(3), random.random())
    checkpoint.set_rng_state(state)
    torch.testing.assert_close(torch.rand(3), expected[0])
    assert random.random() == expected[1]


def _meta_only(directory: Path, meta: checkpoint.CheckpointMeta) -> Path:
    """A ``step_<V>`` holding only ``meta.json`` (what resume_point and the checks read)."""
    import json
    from dataclasses import asdict

    path = directory / f"step_{meta.version}"
    path.mkdir(parents=True)
    (path / checkpoint.META).write_text(json.dumps(asdict(meta)))
    return path


class _DcpTrainer:
    """What FSDP2 looks like to the checkpoint module: no format of its own (DCP)."""

    version = 0


class _NativeTrainer(_DcpTrainer):
    """A backend with its own format (DeepSpeed's shape); loading must never reach it here."""

    checkpoint_format = "deepspeed"

    def save_training_state(self, path: Path) -> None:
        raise AssertionError("not expected")

    def load_training_state(self, path: Path) -> None:
        raise AssertionError("not expected")


def test_a_checkpoint_of_another_format_is_refused_before_any_collective(tmp_path: Path):
    meta = checkpoint.CheckpointMeta(3, 0.0, "", 2, [], {}, "deepspeed")
    step = _meta_only(tmp_path / "a", meta)
    with pytest.raises(ValueError, match="'deepspeed' state; this learner backend reads 'dcp'"):
        checkpoint.load(_DcpTrainer(), step)
    step = _meta_only(tmp_path / "b", checkpoint.CheckpointMeta(3, 0.0, "", 1))
    with pytest.raises(ValueError, match="'dcp' state; this learner backend reads 'deepspeed'"):
        checkpoint.load(_NativeTrainer(), step)


def test_a_native_checkpoint_resumes_only_at_its_world_size(tmp_path: Path) -> None:
    step = _meta_only(tmp_path, checkpoint.CheckpointMeta(3, 0.0, "", 2, [], {}, "deepspeed"))
    with pytest.raises(ValueError, match="written by 2 ranks"):
        checkpoint.load(_NativeTrainer(), step)   # no process group: a world of 1


def test_an_old_meta_without_format_reads_as_dcp(tmp_path: Path) -> None:
    step = tmp_path / "step_1"
    step.mkdir()
    (step / checkpoint.META).write_text('{"version": 1, "time": 0.0, "config_hash": "", '
                                        '"world": 1, "rng": [], "counters": {}}')
    assert checkpoint.read_meta(step).format == checkpoint.DCP


def _fake_checkpoint(directory: Path, version: int, **counters) -> Path:
    return _meta_only(directory, checkpoint.CheckpointMeta(version, 0.0, "", 1, [], counters))


def test_up_resumes_an_unfinished_run_and_archives_a_finished_one(tmp_path: Path) -> None:
    from asyncrl.config import load_config
    from asyncrl.launch.run_dir import is_resuming, write_run_dir

    overrides = [f"run.output_dir={tmp_path}", "run.name=r", "learner.total_steps=20"]
    cfg = load_config(QUICKSTART, overrides)
    assert not is_resuming(cfg)
    step = _fake_checkpoint(cfg.run_dir / "checkpoints", 10)
    (cfg.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    spill = cfg.run_dir / "buffer.spill"        # buffer.zmq.spill_path = "auto"
    spill.write_bytes(b"the broker's journal")
    position = cfg.run_dir / "data" / "worker-0.json"   # a rollout worker's place in data
    position.parent.mkdir()
    position.write_text('{"epoch": 0, "position": 24}')
    (cfg.run_dir / "init_model").mkdir()               # the tiny model the run started from
    assert is_resuming(cfg)
    write_run_dir(cfg, resuming=True)           # metrics are appended to, checkpoints kept
    assert (cfg.run_dir / "metrics.jsonl").exists() and step.exists()
    assert spill.exists()                       # and the broker will replay its journal
    assert position.exists() and (cfg.run_dir / "init_model").is_dir()  # and go on from them
    assert not is_resuming(load_config(QUICKSTART,
                                       [*overrides, "checkpoint.resume=false"]))
    last = _fake_checkpoint(cfg.run_dir / "checkpoints", 20)
    assert is_resuming(cfg)     # the last step, saved by every_steps: not finished (no export)
    checkpoint._update_counters(last, {"finished": True})
    assert not is_resuming(cfg)                 # a finished run: `up` starts a new one
    shutil.rmtree(last)
    checkpoint._update_counters(step, {"finished": True})
    assert not is_resuming(cfg)
    assert is_resuming(load_config(QUICKSTART,
                                   [*overrides, f'checkpoint.path="{step}"']))
    write_run_dir(cfg, resuming=False)
    assert not (cfg.run_dir / "checkpoints").exists() and not is_resuming(cfg)
    assert not (cfg.run_dir / "metrics.jsonl").exists()
    assert not spill.exists()                   # a new run does not replay the old groups...
    kept = list(cfg.run_dir.glob("buffer.*.spill"))
    assert [k.read_bytes() for k in kept] == [b"the broker's journal"]  # ...nor loses them
    # nor reads on from the old run's data positions, nor reuses its initial model
    assert not position.exists() and not (cfg.run_dir / "init_model").exists()
    assert [len(list(cfg.run_dir.glob(f"{name}.*"))) for name in ("data", "init_model")] \
        == [1, 1]


def test_cli_resume_sets_checkpoint_path(tmp_path: Path) -> None:
    from asyncrl.cli import _parser, _resume_override
    from asyncrl.config import load_config

    args = _parser().parse_args(["learner", str(QUICKSTART), "--resume",
                                 str(tmp_path / "step_5")])
    cfg = load_config(args.config, args.overrides + _resume_override(args))
    assert cfg.checkpoint.path == str(tmp_path / "step_5")
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^checkpoint.path \(--resume\): .*step_5 is not a "
                                          r"checkpoint \(no meta.json\)"):
        checkpoint.resume_point(cfg.checkpoint, cfg.run_dir)


def test_a_resume_under_another_lora_setting_is_refused_before_any_state(tmp_path: Path):
    """An adapter checkpoint resumed with LoRA off, another rank or targets (other tensors),
    or another alpha (every adapter re-scaled), fails naming model.lora; the same setting,
    or a meta that predates the record, goes on to the state (here: the format check)."""
    from asyncrl.config.schema import LoraConfig

    trained = checkpoint.lora_record(LoraConfig(rank=8, target_modules=["v_proj", "q_proj"]))
    assert trained == {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
    step = _meta_only(tmp_path, checkpoint.CheckpointMeta(3, 0.0, "", 1, [], {}, "deepspeed",
                                                          trained))
    assert checkpoint.read_meta(step).lora == trained
    for other in (LoraConfig(), LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]),
                  LoraConfig(rank=8, target_modules=["q_proj"]),
                  LoraConfig(rank=8, alpha=32.0, target_modules=["q_proj", "v_proj"])):
        with pytest.raises(ValueError, match=r"trained with model.lora = \{'rank': 8"):
            checkpoint.load(_DcpTrainer(), step, checkpoint.lora_record(other))
    same = checkpoint.lora_record(LoraConfig(rank=8, target_modules=["q_proj", "v_proj"]))
    for lora in (same, None):
        with pytest.raises(ValueError, match="'deepspeed' state"):
            checkpoint.load(_DcpTrainer(), step, lora)
    old = _meta_only(tmp_path / "old", checkpoint.CheckpointMeta(3, 0.0, "", 1, [], {},
                                                                 "deepspeed"))
    with pytest.raises(ValueError, match="'deepspeed' state"):
        checkpoint.load(_DcpTrainer(), old, checkpoint.lora_record(LoraConfig()))


def _checkpointer(tmp_path: Path, *overrides: str) -> checkpoint.Checkpointer:
    from asyncrl.config import load_config

    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", "run.name=r",
                                   "checkpoint.keep=3", *overrides])
    return checkpoint.Checkpointer(cfg)


def _lines(checkpointer: checkpoint.Checkpointer) -> dict[int, str]:
    return {v: checkpoint.read_meta(p).counters["line"]
            for v, p in checkpoint.step_dirs(checkpointer.directory)}


@pytest.mark.usefixtures("one_rank_group")
def test_a_learner_started_from_an_earlier_checkpoint_sets_the_later_ones_aside(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Resumed from step_3 of a line that went on to step_5 (``--resume``), the learner
    trains another line. Before, the old step_5 stayed the newest: a restart resumed the old
    line, and pruning kept the old line's checkpoints before the new one's."""
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(tiny_model_dir, CFG, "cpu")
    first = _checkpointer(tmp_path)
    for version in (2, 3, 4, 5):
        trainer.version = version
        first.save(trainer, {"line": "old"})
    assert _lines(first) == {3: "old", 4: "old", 5: "old"}
    resumed = _checkpointer(tmp_path, f'checkpoint.path="{first.directory / "step_3"}"')
    assert resumed.resume(trainer).version == 3 and trainer.version == 3
    trainer.version = 4
    resumed.save(trainer, {"line": "new"})
    assert _lines(resumed) == {3: "old", 4: "new"}
    assert checkpoint.latest(resumed.directory) == resumed.directory / "step_4"
    (aside,) = resumed.directory.glob("superseded-*")
    assert {p.name: checkpoint.read_meta(p).counters["line"] for p in aside.iterdir()} == {
        "step_4": "old", "step_5": "old"}  # moved, not removed

    fresh = _checkpointer(tmp_path, "checkpoint.resume=false")  # a new line from version 0
    assert fresh.resume(trainer) is None
    trainer.version = 1
    fresh.save(trainer, {"line": "fresh"})
    assert _lines(fresh) == {1: "fresh"}
    assert len(list(fresh.directory.glob("superseded-*"))) == 2


def test_a_save_over_a_checkpoint_of_the_same_version_removes_it_only_once_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between its two renames, the new checkpoint is at ``.tmp`` and the old one at
    ``.old``, both whole (before: the old one was removed first)."""
    final = _fake_checkpoint(tmp_path, 5, line="old")
    tmp = _fake_checkpoint(tmp_path / "t", 5, line="new").rename(tmp_path / "step_5.tmp")
    real_rename = Path.rename

    def killed(self: Path, target):
        if self == tmp:
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._swap_in(tmp, final)
    assert checkpoint.read_meta(tmp_path / "step_5.old").counters == {"line": "old"}
    assert checkpoint.read_meta(tmp).counters == {"line": "new"}
    monkeypatch.undo()
    checkpoint._swap_in(tmp, final)
    assert checkpoint.read_meta(final).counters == {"line": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5", "t"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_resumed_from_another_runs_checkpoint_saves_its_end_as_its_own(tmp_path: Path
                                                                             ) -> None:
    """``--resume`` of another run's checkpoint at ``total_steps``: the run trains no step,
    and its end (``finished``) is saved as a checkpoint of its own. It used to update the
    counters of its own ``checkpoints/step_<V>``, which did not exist: FileNotFoundError."""
    from asyncrl.config import load_config
    from asyncrl.models import prepare_model_dir
    from learners.backends import make_trainer

    base = ["rollout.engine=sim", "learner.backend=sim", "weights.transport=sim",
            "learner.total_steps=3", f"run.output_dir={tmp_path}"]
    old = load_config(None, [*base, "run.name=old"])
    trainer = make_trainer(prepare_model_dir(old.model, old.run_dir, old.run.seed),
                           old.learner, "cpu", sim=old.sim)
    trainer.version = 3
    checkpoint.Checkpointer(old).save(trainer, {"groups_consumed": 96})
    theirs = old.run_dir / "checkpoints" / "step_3"
    new = load_config(None, [*base, "run.name=new", f"checkpoint.path={theirs}"])
    resumed = make_trainer(prepare_model_dir(new.model, new.run_dir, new.run.seed),
                           new.learner, "cpu", sim=new.sim)
    checkpointer = checkpoint.Checkpointer(new)
    assert checkpointer.resume(resumed).version == 3
    checkpointer.save(resumed, {"groups_consumed": 96, "finished": True})
    (version, ours), = checkpoint.step_dirs(new.run_dir / "checkpoints")
    assert version == 3 and checkpoint.read_meta(ours).counters["finished"] is True
    assert "finished" not in checkpoint.read_meta(theirs).counters   # theirs untouched
    # resumed from its own checkpoint, the end only marks it (no second save)
    again = checkpoint.Checkpointer(load_config(None, [*base, "run.name=new"]))
    assert again.resume(resumed).version == 3 and again.saved_version == 3
