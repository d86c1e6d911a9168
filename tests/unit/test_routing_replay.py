"""Routing replay (``learner.routing_replay``): the torch engine records the experts it routed
each token to, they reach the learner's batch, and the learner's forward uses them.

On the tiny Qwen3-MoE (2 layers, 4 experts, 2 per token), real modules, no mocks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.models import EOS_ID, PAD_ID, load_causal_lm
from asyncrl.moe_routing import ROUTING, merge_routing, pad_routing
from learners.batching import collate
from learners.packing import token_logprobs
from learners.routing_replay import RoutingReplay
from rollouters.engines.routing import RoutingRecorder
from rollouters.engines.torch_engine import TorchEngine
from rollouters.workflows.single_turn import generate_groups
from tests.unit.test_fsdp2 import make_groups
from tests.unit.test_moe import moe_dir  # noqa: F401  (the module-scoped fixture)

LAYERS, TOP_K, EXPERTS = 2, 2, 4


def full_forward_routing(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """``[tokens, layers, top_k]``: the routers' choice in one uncached forward."""
    recorder, steps = RoutingRecorder(model), []
    with torch.no_grad(), recorder.record(steps, torch.Size([1, len(tokens)])):
        model(input_ids=torch.tensor([tokens]), use_cache=False)
    recorder.close()
    return steps[0][0].numpy()


def test_the_engine_records_what_a_full_forward_routes(moe_dir: Path) -> None:  # noqa: F811
    """Prompts of different lengths (left padding) and completions that stop at different
    steps: every recorded position equals the uncached forward's choice over prompt +
    completion; the last token, never fed back, is unrecorded."""
    model = load_causal_lm(moe_dir)
    engine = TorchEngine(model, eos_ids=[EOS_ID], pad_id=PAD_ID, seed=0, record_routing=True)
    prompts = [[1, 5, 6, 7, 2], [1, 8, 2], [1, 9, 9, 4, 5, 6, 2]]
    groups = engine.generate(prompts, n=3, temperature=1.0, max_new_tokens=6)
    lengths = set()
    for prompt, completions in zip(prompts, groups):
        for completion in completions:
            tokens = [*prompt, *completion.tokens]
            routing = completion.routing
            assert routing.shape == (len(tokens), LAYERS, TOP_K) and routing.dtype == np.uint8
            assert (routing[-1] == 255).all()
            expected = full_forward_routing(model, tokens)[:-1]
            np.testing.assert_array_equal(np.sort(routing[:-1], -1), np.sort(expected, -1))
            lengths.add(len(completion.tokens))
    assert len(lengths) > 1  # rows finished at different steps


def test_concurrent_generate_calls_each_record_their_own_routing(moe_dir: Path  # noqa: F811
                                                                  ) -> None:
    """Two threads' calls interleave their decode steps under the engine's lock (``on_step``
    makes each wait for the other's step): each call's routing is its own rows' (the steps go
    to the call's batch, the hooks write into the calling thread's list)."""
    import threading

    model = load_causal_lm(moe_dir)
    turns = [threading.Event(), threading.Event()]
    engine = TorchEngine(model, eos_ids=[EOS_ID], pad_id=PAD_ID, seed=2, record_routing=True)
    who = threading.local()

    done = [False, False]

    def hand_over(step: int) -> None:  # after each step, let the other thread take one
        turns[1 - who.index].set()
        if not done[1 - who.index]:
            turns[who.index].wait(timeout=10)
            turns[who.index].clear()

    engine.on_step = hand_over
    prompts = [[1, 5, 6, 7, 2], [1, 9, 8, 2]]
    results: list = [None, None]

    def run(index: int) -> None:
        who.index = index
        if index == 1:
            turns[1].wait(timeout=10)
            turns[1].clear()
        results[index] = engine.generate([prompts[index]], n=2, temperature=1.0,
                                         max_new_tokens=5)[0]
        done[index] = True  # never keep the other waiting
        turns[1 - index].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for prompt, completions in zip(prompts, results):
        for completion in completions:
            tokens = [*prompt, *completion.tokens]
            expected = full_forward_routing(model, tokens)[:-1]
            np.testing.assert_array_equal(np.sort(completion.routing[:-1], -1),
                                          np.sort(expected, -1))


def test_routing_travels_from_the_engine_into_the_learners_batch(moe_dir: Path  # noqa: F811
                                                                  ) -> None:
    from asyncrl.config.schema import TaskConfig
    from rollouters.tasks.digits import make_task

    model = load_causal_lm(moe_dir)
    engine = TorchEngine(model, eos_ids=[EOS_ID], pad_id=PAD_ID, seed=1, record_routing=True)
    task = make_task(TaskConfig(name="copy", length=3, eval_size=2), seed=0)
    prompts = task.eval_prompts()
    groups = generate_groups(engine, task, prompts, group_size=2, temperature=1.0,
                             max_new_tokens=4)
    batch = collate(groups, std_norm=True, pad_id=PAD_ID)
    assert batch.routing is not None and batch.routing.shape[2:] == (LAYERS, TOP_K)
    row = 0
    for group in groups:
        assert group.extras[ROUTING].shape == (group.num_tokens, LAYERS, TOP_K)
        for sample in group.sample_slices():
            n = sample.stop - sample.start
            np.testing.assert_array_equal(batch.routing[row, :n].numpy(),
                                          group.extras[ROUTING][sample])
            assert (batch.routing[row, n:] == -1).all()  # padding: unrecorded
            row += 1


def routed_batch(model: torch.nn.Module):
    """A collated batch whose ``routing`` is the model's own choice in the padded forward."""
    batch = collate(make_groups(n_groups=2, group_size=3), std_norm=True, pad_id=PAD_ID)
    recorder, steps = RoutingRecorder(model), []
    with torch.no_grad(), recorder.record(steps, batch.input_ids.shape):
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    recorder.close()
    return replace(batch, routing=steps[0])


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_replaying_the_learners_own_routing_changes_nothing_and_another_does(
        moe_dir: Path, packing: bool) -> None:  # noqa: F811
    model = load_causal_lm(moe_dir, dtype="float32")
    batch = routed_batch(model)
    with torch.no_grad():
        own = token_logprobs(model, batch, packing)
    replay = RoutingReplay(model, packing)
    replay.use(batch)
    with torch.no_grad():
        replayed = token_logprobs(model, batch, packing)
    if packing:  # the packed forward's own choice may differ from the padded one's by a tie
        torch.testing.assert_close(replayed, own, atol=1e-5, rtol=0)
    else:
        assert torch.equal(replayed, own)
    other = replace(batch, routing=(batch.routing + 1) % EXPERTS)
    replay.use(other)
    changed = token_logprobs(model, other, packing)
    mask = batch.loss_mask
    assert (changed - own)[mask].abs().max() > 1e-3
    changed[mask].sum().backward()  # the router still trains: its scores come from its logits
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0
               for r in replay.routers)
    replay.use(None)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, batch, packing), own)
    replay.close()


def test_unrecorded_positions_are_routed_by_the_learner(moe_dir: Path) -> None:  # noqa: F811
    model = load_causal_lm(moe_dir)
    batch = routed_batch(model)
    with torch.no_grad():
        own = token_logprobs(model, batch)
        replay = RoutingReplay(model, packing=False)
        replay.use(replace(batch, routing=torch.full_like(batch.routing, -1)))
        assert torch.equal(token_logprobs(model, batch), own)
    replay.close()


def test_a_multi_turn_sample_keeps_each_turns_own_routing() -> None:
    first = np.array([[[0, 1]], [[2, 3]], [[255, 255]]], dtype=np.uint8)  # turn 1, 3 tokens
    second = np.array([[[1, 0]], [[3, 2]], [[0, 2]], [[1, 3]], [[255, 255]]], dtype=np.uint8)
    merged = merge_routing(first, second)
    np.testing.assert_array_equal(merged[:, 0], [[0, 1], [2, 3], [0, 2], [1, 3], [255, 255]])
    padded = pad_routing(merged, 7)  # tool output after the last turn
    assert padded.shape == (7, 1, 2) and (padded[5:] == 255).all()


@pytest.mark.parametrize("sets, expected", [
    (["model.tiny.num_experts=0"], "learner.routing_replay = true needs an MoE model"),
    (["rollout.engine='vllm'"], "its CPU install refuses them"),
    (["rollout.engine='sim'"], "does not record the experts"),
])
def test_routing_replay_is_refused_where_it_cannot_work(sets: list[str], expected: str) -> None:
    root = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError) as error:
        load_config(root / "configs/moe_quickstart.toml", ["learner.routing_replay=true", *sets])
    assert expected in str(error.value) and "learner.routing_replay" in str(error.value)


def test_a_dense_model_is_refused_when_the_replay_is_built(tmp_path: Path) -> None:
    from asyncrl.config.schema import ModelConfig
    from asyncrl.models import prepare_model_dir

    dense = prepare_model_dir(ModelConfig.model_validate({"tiny": {"hidden_size": 64}}),
                              tmp_path, seed=0)
    with pytest.raises(ValueError, match="learner.routing_replay = true but Qwen2ForCausalLM"):
        RoutingReplay(load_causal_lm(dense), packing=False)


def test_workflow_episodes_carry_a_routing_row_per_token() -> None:
    """The workflow path (episode runner, batched engine calls, ``Trajectory``): each sample's
    routing, through the wire, is what an uncached forward over its tokens routes, wherever the
    engine routed the position (all but each turn's last token, and tool output after it)."""
    import asyncio
    import random

    from asyncrl.config.schema import TinyModelConfig
    from asyncrl.models import build_tiny_model
    from asyncrl.wire import decode_group, encode_group
    from rollouters.envs.lookup import LookupEnv
    from rollouters.workflows.batching import BatchingEngine
    from rollouters.workflows.runner import EpisodeRunner
    from tests.unit.test_moe import MOE
    from tests.unit.test_workflows import TOKENIZER, _workflow

    model = build_tiny_model(TinyModelConfig(**MOE), len(TOKENIZER), seed=0)
    engine = TorchEngine(model, eos_ids=(EOS_ID,), pad_id=PAD_ID, seed=0, record_routing=True)
    runner = EpisodeRunner(_workflow(), BatchingEngine(engine, temperature=1.0,
                                                       max_new_tokens=5), max_staleness=2)
    groups = asyncio.run(runner.groups(LookupEnv.samples(random.Random(0), 2), group_size=2))
    for group in groups:
        routing = decode_group(encode_group(group)).extras[ROUTING]
        assert routing.shape == (group.num_tokens, LAYERS, TOP_K)
        for sample in group.sample_slices():
            recorded = (routing[sample] != 255).all(axis=(1, 2))
            assert recorded[:-1].any() and not recorded[-1]
            expected = full_forward_routing(model, group.tokens[sample].tolist())
            np.testing.assert_array_equal(np.sort(routing[sample][recorded], -1),
                                          np.sort(expected[recorded], -1))
