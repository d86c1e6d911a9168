"""The single-turn workflow: consistent per-token arrays that survive the wire format."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import random  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from asyncrl.config.schema import TinyModelConfig  # noqa: E402
from asyncrl.models import EOS_ID, PAD_ID, VOCAB, build_tiny_model  # noqa: E402
from asyncrl.wire import decode_group, encode_group  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402
from rollouters.eval import evaluate  # noqa: E402
from rollouters.tasks import DigitTask  # noqa: E402
from rollouters.workflows import generate_groups  # noqa: E402

torch.set_num_threads(1)


def _engine() -> TorchEngine:
    model = build_tiny_model(TinyModelConfig(), len(VOCAB), seed=0)
    return TorchEngine(model, eos_ids=(EOS_ID,), pad_id=PAD_ID, version=3, seed=0)


def test_groups_are_consistent_and_round_trip() -> None:
    task = DigitTask("copy", 4, 16, seed=0)
    prompts = task.sample(random.Random(0), 3)
    groups = generate_groups(_engine(), task, prompts, group_size=4, temperature=1.0,
                             max_new_tokens=6, run_id="run-x")
    assert [g.prompt_id for g in groups] == [p.prompt_id for p in prompts]
    assert len({g.group_id for g in groups}) == 3
    for prompt, group in zip(prompts, groups):
        assert group.size == 4 and group.run_id == "run-x"
        assert group.tokens.shape == group.logprobs.shape == group.loss_mask.shape \
            == group.versions.shape == (sum(group.lengths),)
        for i, sl in enumerate(group.sample_slices()):
            n_prompt = len(prompt.tokens)
            completion = group.tokens[sl][n_prompt:].tolist()
            assert group.tokens[sl][:n_prompt].tolist() == prompt.tokens
            assert group.loss_mask[sl].tolist() == [0] * n_prompt + [1] * len(completion)
            assert (group.logprobs[sl][:n_prompt] == 0).all()
            assert (group.logprobs[sl][n_prompt:] <= 0).all()
            assert group.versions[sl].tolist() == [-1] * n_prompt + [3] * len(completion)
            assert group.rewards[i] == task.reward(prompt, completion)
            assert group.finish_reasons[i] == ("stop" if completion[-1] == EOS_ID else "length")
        decoded = decode_group(encode_group(group))
        assert (decoded.group_id, decoded.prompt_id, decoded.rewards, decoded.lengths) == \
            (group.group_id, group.prompt_id, group.rewards, group.lengths)
        for name in ("tokens", "logprobs", "loss_mask", "versions"):
            np.testing.assert_array_equal(getattr(decoded, name), getattr(group, name))


def test_empty_prompt_list() -> None:
    assert generate_groups(_engine(), DigitTask("copy", 4, 8, 0), [], 4, 1.0, 6) == []


def test_evaluate_reports_greedy_accuracy() -> None:
    task = DigitTask("copy", 3, 20, seed=0)
    metrics = evaluate(_engine(), task, max_new_tokens=4, batch_size=8)
    assert metrics["val/num_prompts/copy"] == 20
    assert 0.0 <= metrics["val/test_score/copy"] <= metrics["val/position_score/copy"] <= 1.0
    assert metrics == evaluate(_engine(), task, max_new_tokens=4, batch_size=20)


class _OracleEngine:
    """Answers every prompt with its target: evaluation must then report 1.0."""

    version = 0

    def __init__(self, task: DigitTask) -> None:
        self.targets = {tuple(p.tokens): p.target for p in task.eval_prompts()}

    def generate(self, prompts, n, temperature, max_new_tokens, greedy=False):
        from rollouters.engines.base import Completion

        assert greedy
        return [[Completion(self.targets[tuple(p)], [0.0] * 4, [0] * 4, "stop")] for p in prompts]


def test_evaluate_perfect_engine() -> None:
    task = DigitTask("sort", 3, 10, seed=0)
    assert evaluate(_OracleEngine(task), task, max_new_tokens=4, batch_size=3) == \
        {"val/test_score/sort": 1.0, "val/position_score/sort": 1.0, "val/num_prompts/sort": 10}
