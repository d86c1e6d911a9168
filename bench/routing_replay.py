"""Routing replay: the train/inference mismatch with and without it, on the same samples.

The tiny Qwen3-MoE of ``configs/moe_quickstart.toml`` (or ``--model-dir``, e.g. a trained
checkpoint) samples completions of the copy task's prompts with the torch engine (KV-cached,
batched, left-padded decode) recording its routing; the groups go through the wire format
(encode, decode). The learner's model, loaded from the same files in ``--learner-dtype``,
then computes the logprobs of the same tokens by its own forward (padded, uncached) twice:
routing by itself, and replaying the engine's routing (``learners.routing_replay``). Reported
over the generated tokens: ``mean |Δlogp|`` (learner − engine, as ``mismatch/abs_logp``), its
p99 and max, and the share of (token, layer) pairs whose expert set the learner's own router
chose differently from the engine.

On a CPU in fp32 both forwards are nearly the same arithmetic, so the mismatch is tiny either
way; a bf16 engine against an fp32 learner is where routing flips from numerics, and a learner
some versions ahead of the engine (``--learner-model-dir``) where it flips from staleness.

    python bench/routing_replay.py                                  # fp32 and bf16 cases
    python bench/routing_replay.py --model-dir runs/moe_quickstart/final --cases bfloat16/float32
    python bench/routing_replay.py --model-dir runs/moe_quickstart/checkpoints/step_50 \
        --learner-model-dir runs/moe_quickstart/checkpoints/step_80 --cases float32/float32
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.models import load_causal_lm, prepare_model_dir  # noqa: E402
from asyncrl.moe_routing import ROUTING  # noqa: E402
from asyncrl.wire import decode_group, encode_group  # noqa: E402
from learners.batching import TrainBatch, collate  # noqa: E402
from learners.packing import token_logprobs  # noqa: E402
from learners.routing_replay import RoutingReplay  # noqa: E402
from rollouters.engines.routing import RoutingRecorder  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402
from rollouters.tasks.digits import make_task  # noqa: E402
from rollouters.workflows.single_turn import generate_groups  # noqa: E402

logger = logging.getLogger("bench.routing_replay")
CONFIG = ROOT / "configs" / "moe_quickstart.toml"


def sample_batch(model_dir: Path, dtype: str, prompts: int, seed: int) -> TrainBatch:
    """The engine's groups (in ``dtype``) through the wire, collated as the learner does."""
    cfg = load_config(CONFIG)
    from asyncrl.tokens import special_tokens

    special = special_tokens(model_dir)
    engine = TorchEngine(load_causal_lm(model_dir, dtype), eos_ids=special.eos_ids,
                         pad_id=special.pad_id, seed=seed, record_routing=True)
    task = make_task(cfg.task.model_copy(update={"eval_size": prompts}), seed)
    groups = generate_groups(engine, task, task.eval_prompts(), cfg.rollout.group_size,
                             cfg.rollout.temperature, cfg.rollout.max_new_tokens)
    groups = [decode_group(encode_group(g)) for g in groups]
    assert all(ROUTING in g.extras for g in groups)
    return collate(groups, std_norm=True, pad_id=special.pad_id)


def hf_dir(path: Path, tmp: Path) -> Path:
    """``path`` itself when it is an HF model directory (``final/``); a learner checkpoint
    (``checkpoints/step_V``) is loaded into its run's initial model (``asyncrl eval``'s way)
    and saved under ``tmp``, with the run's tokenizer."""
    if (path / "config.json").is_file():
        return path
    from asyncrl.eval_checkpoint import load_policy
    from learners.backends.micro_steps import TOKENIZER_FILES

    run_dir = path.parents[1]
    model, _, init_dir = load_policy(load_config(run_dir / "config.toml"), path)
    out = tmp / path.name
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(init_dir) / name).is_file():
            (out / name).write_bytes((Path(init_dir) / name).read_bytes())
    return out


def own_routing(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    recorder, steps = RoutingRecorder(model), []
    with torch.no_grad(), recorder.record(steps, batch.input_ids.shape):
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    recorder.close()
    return steps[0]


def measure(model_dir: Path, learner_dir: Path, engine_dtype: str, learner_dtype: str,
            prompts: int, seed: int) -> dict[str, float | str]:
    batch = sample_batch(model_dir, engine_dtype, prompts, seed)
    model = load_causal_lm(learner_dir, learner_dtype)
    mask = batch.loss_mask
    engine_logp = batch.behaviour_logprobs[mask]
    row = {"engine": engine_dtype, "learner": learner_dtype, "tokens": int(mask.sum())}
    replay = RoutingReplay(model, packing=False)
    for name, routed in (("own", None), ("replay", batch)):
        replay.use(routed)
        with torch.no_grad():
            delta = (token_logprobs(model, batch)[mask] - engine_logp).abs().double()
        row[f"{name}_abs_logp"] = float(delta.mean())
        row[f"{name}_p99"] = float(torch.quantile(delta, 0.99))
        row[f"{name}_max"] = float(delta.max())
    replay.use(None)
    # Routing flips: the learner's own expert set vs the engine's, on the positions the
    # engine routed whose next token is trained (the inputs that produce trained logprobs).
    own = own_routing(model, batch).sort(-1).values
    engine = batch.routing.long().sort(-1).values
    recorded = (engine[..., 0] >= 0) & (engine[..., -1] < replay.routers[0].num_experts)
    used = recorded & mask.unsqueeze(-1)
    row["routing_differs"] = float((own != engine).any(-1)[used].double().mean())
    replay.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: the moe quickstart's init model")
    parser.add_argument("--learner-model-dir", type=Path,
                        help="the learner's weights, when not the engine's: a later checkpoint "
                             "of the same run stands for a stale sample")
    parser.add_argument("--cases", nargs="+",
                        default=["float32/float32", "bfloat16/bfloat16", "bfloat16/float32"],
                        help="engine dtype/learner dtype")
    parser.add_argument("--prompts", type=int, default=32, help="x group_size 16 samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (hf_dir(args.model_dir, Path(tmp)) if args.model_dir else
                     prepare_model_dir(load_config(CONFIG).model, Path(tmp), seed=args.seed))
        learner_dir = hf_dir(args.learner_model_dir, Path(tmp)) if args.learner_model_dir \
            else model_dir
        for case in args.cases:
            engine_dtype, learner_dtype = case.split("/")
            row = measure(model_dir, learner_dir, engine_dtype, learner_dtype, args.prompts,
                          args.seed)
            print(json.dumps({k: round(v, 8) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
