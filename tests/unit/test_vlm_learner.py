"""The learner with a vision-language model: FSDP2 over vision and language blocks, the forward
recomputing pixels from the wire's image bytes, and weight updates with the vision tower frozen
(``model.freeze_vision``, the default: not sent) and trained (sent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.config.schema import LearnerConfig, ModelConfig, TaskConfig
from asyncrl.wire import decode_group, encode_group
from tests.unit.test_fsdp2 import spawn_runs
from tests.unit.test_vlm import TINY_VLM

VISION = "model.visual.blocks.0.attn.qkv.weight"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.models import prepare_model_dir

    cfg = ModelConfig.model_validate({"tiny": TINY_VLM})
    return prepare_model_dir(cfg, tmp_path_factory.mktemp("vlm"), seed=0)


def _engine_and_task(model_dir: str):
    from asyncrl.models import load_causal_lm
    from asyncrl.vlm import load_image_processor
    from rollouters.engines.torch_engine import TorchEngine
    from rollouters.tasks import make_task

    engine = TorchEngine(load_causal_lm(model_dir), eos_ids=[3], pad_id=0, seed=0,
                         image_processor=load_image_processor(model_dir))
    tiny = ModelConfig.model_validate({"tiny": TINY_VLM}).tiny
    return engine, make_task(TaskConfig(name="colour", eval_size=8), 0, tiny)


def _batch(engine, task, vision, seed: int):
    """Four colour prompts, 3 samples each, through the wire and the learner's image path."""
    import random

    from learners.batching import collate
    from rollouters.workflows.single_turn import generate_groups

    groups = generate_groups(engine, task, task.sample(random.Random(seed), 4), 3, 1.0, 3)
    groups = [decode_group(encode_group(g)) for g in groups]   # the images travel as bytes
    kept, inputs, dropped = vision.prepare(groups)
    assert len(kept) == 4 and not dropped
    return collate(kept, std_norm=True, pad_id=0, vision=inputs)


def _mismatch(trainer, batch) -> float:
    """Largest |learner logprob − engine logprob| over the generated tokens."""
    from learners.packing import token_logprobs

    with torch.no_grad():
        logprobs = token_logprobs(trainer.model, batch)
    return float((logprobs - batch.behaviour_logprobs)[batch.loss_mask].abs().max())


def _train_vlm(rank: int, world: int, device: torch.device, model_dir: str, out_dir: str,
               freeze: bool) -> None:
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.lora import without_frozen_vision
    from learners.vision import LearnerVision

    trainer = Fsdp2Trainer(model_dir, LearnerConfig(lr=1e-2), device, freeze_vision=freeze)
    engine, task = _engine_and_task(model_dir)
    vision = LearnerVision.of(model_dir)
    before = engine.state_dict()
    batch = _batch(engine, task, vision, seed=0)
    units = [name for name, module in trainer.model.named_modules()
             if name and type(module).__name__.startswith("FSDP")]   # fully_shard-ed blocks
    result = {"blocks": units, "mismatch_before": _mismatch(trainer, batch)}
    result["metrics"] = trainer.train_step(batch)
    result["stale"] = _mismatch(trainer, batch)   # the old weights' logprobs vs the new ones
    state = trainer.full_state_dict()
    sent = without_frozen_vision(state) if freeze else state
    engine.load_weights(sent.items(), version=1)
    after = engine.state_dict()
    result["sent_vision"] = sum(name.startswith("model.visual.") for name in sent)
    result["vision_moved"] = float((after[VISION] - before[VISION]).abs().max())
    result["text_moved"] = float((after["lm_head.weight"] - before["lm_head.weight"]).abs().max())
    result["mismatch_after"] = _mismatch(trainer, _batch(engine, task, vision, seed=1))
    torch.save(result, Path(out_dir) / "result.pt")


def _train_vlm_shares(rank: int, world: int, device: torch.device, model_dir: str,
                      out_dir: str) -> None:
    """Two ranks: rank 0's batch scattered with its images, each rank's share recomputed."""
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.balance import scatter_batch
    from learners.vision import LearnerVision

    trainer = Fsdp2Trainer(model_dir, LearnerConfig(lr=1e-2), device, freeze_vision=False)
    engine, task = _engine_and_task(model_dir)
    batch = _batch(engine, task, LearnerVision.of(model_dir), seed=0) if rank == 0 else None
    share = scatter_batch(batch, rank, world)
    result = {"rows": share.num_samples, "mismatch": _mismatch(trainer, share),
              "metrics": trainer.train_step(share)}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _run(rank: int, world: int, device: torch.device, model_dir: str, out_dir: str,
         freeze: bool | None) -> None:
    if freeze is None:
        _train_vlm_shares(rank, world, device, model_dir, out_dir)
    else:
        _train_vlm(rank, world, device, model_dir, out_dir, freeze)


def test_fsdp2_trains_a_vlm_and_the_engines_match_it_frozen_or_not(vlm_dir: Path,
                                                                   tmp_path: Path) -> None:
    """Frozen and trained tower on one rank; two ranks scattering a VLM batch."""
    # One spawn: the world-1 runs take turns in one process while the two ranks run.
    out = spawn_runs(_run, vlm_dir, tmp_path, {"frozen": (1, (True,)), "trained": (1, (False,)),
                                               "shares": (2, (None,))}, timeout_s=120)
    shares = out["shares"]
    for rank in (0, 1):   # each rank got its rows' images with their tokens
        saved = torch.load(shares / f"rank{rank}.pt", weights_only=False)
        assert saved["rows"] == 6 and saved["mismatch"] < 1e-4, saved
        assert saved["metrics"]["actor/grad_norm"] > 0
    frozen = torch.load(out["frozen"] / "result.pt", weights_only=False)
    trained = torch.load(out["trained"] / "result.pt", weights_only=False)
    # Vision and language blocks are each an FSDP2 unit of their own.
    assert frozen["blocks"] == ["model.visual.blocks.0", "model.language_model.layers.0",
                                "model.language_model.layers.1"]
    for run in (frozen, trained):
        # The engine's behaviour logprobs are the learner's recompute from the image bytes,
        # before the update and after the weights were sent (float32 rounding of a KV-cached
        # left-padded decode against one right-padded forward; the step moved them by more).
        assert run["mismatch_before"] < 1e-4 and run["mismatch_after"] < 1e-3, run
        assert run["stale"] > 20 * run["mismatch_after"], run
        assert run["text_moved"] > 0 and run["metrics"]["actor/grad_norm"] > 0
    assert frozen["sent_vision"] == 0 and frozen["vision_moved"] == 0.0
    assert trained["sent_vision"] > 0 and trained["vision_moved"] > 0


def test_a_group_with_bad_images_is_dropped_and_counted(vlm_dir: Path) -> None:
    from asyncrl.wire.images import IMAGES
    from learners.vision import LearnerVision
    from rollouters.workflows.single_turn import generate_groups

    engine, task = _engine_and_task(str(vlm_dir))
    groups = generate_groups(engine, task, task.eval_prompts()[:3], 2, 1.0, 2)
    corrupt = groups[1].extras[IMAGES].copy()
    corrupt[20:] = 7                                    # a PNG signature, then garbage
    groups[1].extras[IMAGES] = corrupt
    groups[2].extras.pop(IMAGES)
    kept, inputs, dropped = LearnerVision.of(vlm_dir).prepare(groups)
    assert [g.group_id for g in kept] == [groups[0].group_id]
    assert dropped == {"image_decode": 1, "images": 1}
    assert inputs[0][1].tolist() == [[1, 2, 2]] and np.isfinite(inputs[0][0].numpy()).all()
