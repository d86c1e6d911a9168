"""Generated and trained tokens/s with images against the same run text-only.

The tiny Qwen2-VL of ``configs/vlm_quickstart.toml`` (or ``--image-size`` / ``--depth`` /
``--hidden`` to grow it). ``--prompts`` colour-task prompts, ``--n`` samples each, every row
generating exactly ``--new-tokens`` tokens (no EOS), on the torch engine; then one FSDP2
``train_step`` (world 1, gloo) on the resulting groups; the collate, which recomputes the
pixels from the PNG bytes as the learner does on its prefetch thread (overlapped with the step
before), is timed apart (``collate_s``). The text-only case is the same model on the same ids with each image
pad token replaced by a digit and no image: same sequence lengths, no vision tower, no image
decode. Both cases alternate, ``--repeats`` times each, so both see the same machine load;
the median is reported.

    OMP_NUM_THREADS=1 .venv/bin/python bench/vlm_throughput.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/vlm_throughput.py --image-size 112 --depth 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config.load import load_config  # noqa: E402
from asyncrl.config.schema import LearnerConfig  # noqa: E402
from asyncrl.models import DIGIT_OFFSET, load_causal_lm, prepare_model_dir  # noqa: E402
from asyncrl.net import free_port  # noqa: E402
from asyncrl.vlm import load_image_processor  # noqa: E402
from learners.dist import init_learner_group, shutdown_learner_group  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402
from rollouters.tasks import make_task  # noqa: E402
from rollouters.workflows.single_turn import generate_groups  # noqa: E402

CONFIG = ROOT / "configs" / "vlm_quickstart.toml"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    return parser.parse_args()


def setup(args: argparse.Namespace, directory: Path):
    """The model dir, the engine, and the image prompts with their text-only twins."""
    cfg = load_config(CONFIG, [f"model.tiny.vision.image_size={args.image_size}",
                               f"model.tiny.vision.depth={args.depth}",
                               f"model.tiny.hidden_size={args.hidden}"])
    model_dir = prepare_model_dir(cfg.model, directory, seed=0)
    vocab = load_causal_lm(model_dir).config.text_config.vocab_size
    engine = TorchEngine(load_causal_lm(model_dir), eos_ids=[vocab + 1], pad_id=0, seed=0,
                         image_processor=load_image_processor(model_dir))
    task = make_task(cfg.task, 0, cfg.model.tiny)
    prompts = task.sample(random.Random(0), args.prompts)
    digit = DIGIT_OFFSET + 5
    text = [replace(p, tokens=[digit if t == task.image_pad else t for t in p.tokens],
                    images=()) for p in prompts]
    return model_dir, engine, task, {"images": prompts, "text": text}


def main() -> None:
    args = parse()
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.batching import collate
    from learners.vision import LearnerVision

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, engine, task, cases = setup(args, Path(tmp))
        init_learner_group(0, 1, master_port=free_port(), device="cpu")
        vision = LearnerVision.of(model_dir)
        trainers = {name: Fsdp2Trainer(model_dir, LearnerConfig(lr=1e-5), "cpu",
                                       freeze_vision=False) for name in cases}
        gen: dict[str, list[float]] = {name: [] for name in cases}
        train: dict[str, list[float]] = {name: [] for name in cases}
        pixels: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, prompts in cases.items():
                start = time.perf_counter()
                groups = generate_groups(engine, task, prompts, args.n, 1.0, args.new_tokens)
                gen[name].append(args.prompts * args.n * args.new_tokens
                                 / (time.perf_counter() - start))
                start = time.perf_counter()   # the prefetch thread's part: overlapped
                kept, inputs, _ = vision.prepare(groups)
                batch = collate(kept, std_norm=True, pad_id=0, vision=inputs)
                pixels[name].append(time.perf_counter() - start)
                start = time.perf_counter()
                trainers[name].train_step(batch)
                train[name].append(int(batch.lengths.sum()) / (time.perf_counter() - start))
        shutdown_learner_group()
    result = {name: {"generated_tokens_per_s": statistics.median(gen[name]),
                     "trained_tokens_per_s": statistics.median(train[name]),
                     "collate_s": statistics.median(pixels[name])}
              for name in cases}
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
