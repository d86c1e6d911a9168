"""Workflows: the multi-turn agent loop over the lookup env (token-exact chat template, tool
tokens masked out of the loss, per-turn logprobs and versions), batching of concurrent
episodes onto a real engine, staleness policies, and loading user code by import path."""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from asyncrl.config import ConfigError, load_config  # noqa: E402
from asyncrl.config.schema import TinyModelConfig  # noqa: E402
from asyncrl.models import EOS_ID, PAD_ID, build_char_tokenizer, build_tiny_model  # noqa: E402
from asyncrl.wire import decode_group, encode_group  # noqa: E402
from rollouters.engines.base import Completion  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402
from rollouters.envs.lookup import LookupEnv  # noqa: E402
from rollouters.tasks.sample import Sample  # noqa: E402
from rollouters.workflows.batching import BatchingEngine  # noqa: E402
from rollouters.workflows.chat import ChatFormat, parse_tool_call  # noqa: E402
from rollouters.workflows.factory import make_workflow  # noqa: E402
from rollouters.workflows.multi_turn import MultiTurnWorkflow  # noqa: E402
from rollouters.workflows.runner import EpisodeRunner  # noqa: E402

torch.set_num_threads(1)
EXTRA = ["lookup(", ")"]
TOKENIZER = build_char_tokenizer(EXTRA)


class ScriptedEngine:
    """An EpisodeEngine that answers with fixed texts; its version moves when told to."""

    def __init__(self, replies: list[str], versions: list[int]) -> None:
        self.replies, self.versions, self.calls = list(replies), list(versions), 0
        self._version = versions[0]

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, tokens: list[int], max_new_tokens: int | None = None
                       ) -> Completion:
        self._version = self.versions[self.calls]
        ids = TOKENIZER.encode(self.replies[self.calls], add_special_tokens=False) + [EOS_ID]
        self.calls += 1
        return Completion(ids, [-0.5] * len(ids), [self._version] * len(ids), "stop")


class FixedValueRng:
    def choice(self, seq: str) -> str:
        return "7"


def _workflow() -> MultiTurnWorkflow:
    return MultiTurnWorkflow(lambda: LookupEnv(rng=FixedValueRng()), ChatFormat(TOKENIZER),
                             "compact", max_turns=3)


def test_tool_tokens_are_in_the_trajectory_but_masked_out() -> None:
    engine = ScriptedEngine(["lookup(12)", "77"], versions=[3, 4])
    traj = asyncio.run(_workflow().run_episode(engine, Sample("k", "12", fields={"key": "12"})))
    text = TOKENIZER.decode(traj.tokens, skip_special_tokens=False)
    assert text == "<bos>12<sep>lookup(12)<eos>77<sep>77<eos>"
    mask = "".join(str(m) for m in traj.loss_mask)
    # prompt (4) masked, call (5) trained, tool reply 7 7 <sep> masked, answer (3) trained
    assert mask == "0000" + "11111" + "000" + "111"
    assert traj.versions == [-1] * 4 + [3] * 5 + [-1] * 3 + [4] * 3  # weights changed between
    assert traj.logprobs == [0.0] * 4 + [-0.5] * 5 + [0.0] * 3 + [-0.5] * 3
    assert [(s.start, s.end, s.reward) for s in traj.steps] == [(4, 9, 0.5), (12, 15, 0.5)]
    assert traj.total_reward == 1.0


def test_a_response_that_is_no_tool_call_ends_the_episode() -> None:
    traj = asyncio.run(_workflow().run_episode(ScriptedEngine(["55"], [0]),
                                               Sample("k", "12", fields={"key": "12"})))
    assert len(traj.steps) == 1 and traj.total_reward == 0.0


def test_lookup_rewards_content_not_syntax() -> None:
    sample = Sample("k", "12", fields={"key": "12"})
    wrong_key = asyncio.run(_workflow().run_episode(ScriptedEngine(["lookup(13)", "77"], [0, 0]),
                                                    sample))
    assert [s.reward for s in wrong_key.steps] == [pytest.approx(0.1 + 0.4 * 2 / 3), 0.5]
    # the tool's name where the answer belongs earns nothing, not even the end of the turn
    spam = asyncio.run(_workflow().run_episode(
        ScriptedEngine(["lookup(12", "lookup("], [0, 0]), sample))
    assert [s.reward for s in spam.steps] == [0.5, 0.0]


def test_tool_call_formats() -> None:
    assert parse_tool_call("lookup(12)", "compact").arguments == {"arg": "12"}
    assert parse_tool_call("lookup(4", "compact").arguments == {"arg": "4"}  # turn end closes
    assert parse_tool_call("12", "compact") is None
    call = parse_tool_call('ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
                           "hermes")
    assert call.name == "f" and call.arguments == {"x": 1}
    assert parse_tool_call("<tool_call>{bad json}</tool_call>", "hermes") is None


def test_episodes_on_a_real_engine_batch_and_survive_the_wire() -> None:
    model = build_tiny_model(TinyModelConfig(), len(TOKENIZER), seed=0)
    engine = TorchEngine(model, eos_ids=(EOS_ID,), pad_id=PAD_ID, version=2, seed=0)
    batching = BatchingEngine(engine, temperature=1.0, max_new_tokens=5)
    runner = EpisodeRunner(_workflow(), batching, max_staleness=2)
    samples = LookupEnv.samples(__import__("random").Random(0), 3)
    groups = asyncio.run(runner.groups(samples, group_size=4, run_id="r"))
    assert len(groups) == 3 and batching.calls <= 3 * 2  # one engine call per turn, not per ep.
    for group in groups:
        decoded = decode_group(encode_group(group))
        assert decoded.metadata["steps"] == group.metadata["steps"]
        for i, sl in enumerate(group.sample_slices()):
            spans = group.metadata["steps"][i]
            trained = np.zeros(sl.stop - sl.start, dtype=np.uint8)
            for start, end in spans:
                trained[start:end] = 1
            np.testing.assert_array_equal(group.loss_mask[sl], trained)
            assert (group.versions[sl][trained == 1] == 2).all()
            assert group.rewards[i] == pytest.approx(sum(group.metadata["step_rewards"][i]))


def test_stale_episodes_are_requeued_then_dropped() -> None:
    # every call sees the engine 3 versions ahead of the trajectory's first turn
    class Drifting(ScriptedEngine):
        async def generate(self, tokens, max_new_tokens=None):
            completion = await super().generate(tokens, max_new_tokens)
            self._version += 3
            return completion

    def runner(policy: str) -> EpisodeRunner:
        engine = Drifting(["lookup(12)", "77"] * 3, [0, 0, 3, 3, 6, 6])
        return EpisodeRunner(_workflow(), engine, max_staleness=2, stale_policy=policy,
                             max_requeues=2)

    sample = Sample("k", "12", fields={"key": "12"})
    drop = runner("drop")
    assert asyncio.run(drop.episode(sample)) is None
    assert drop.counts["episodes_dropped_stale"] == 1 and drop.workflow is not None
    requeue = runner("requeue")
    assert asyncio.run(requeue.episode(sample)) is None
    assert requeue.counts["episodes_requeued_stale"] == 2
    assert requeue.counts["episodes_dropped_stale"] == 1


def test_an_episode_spanning_updates_within_the_bound_goes_on() -> None:
    engine = ScriptedEngine(["lookup(12)", "77"], versions=[5, 7])
    runner = EpisodeRunner(_workflow(), engine, max_staleness=2)
    traj = asyncio.run(runner.episode(Sample("k", "12", fields={"key": "12"})))
    assert traj is not None and traj.min_version() == 5 and max(traj.versions) == 7


def not_a_factory(ctx):
    return 3


async def failing_episode(engine, sample):
    raise RuntimeError("user bug")


def test_a_failing_user_workflow_loses_the_episode_not_the_worker() -> None:
    cfg = load_config(None, ["workflow.type=custom",
                             "workflow.path=tests.unit.test_workflows:failing_episode"])
    runner = EpisodeRunner(make_workflow(cfg, TOKENIZER, 0), ScriptedEngine(["x"], [0]), 2)
    assert asyncio.run(runner.group(Sample("s", "p"), 2)) is None
    assert runner.counts["episodes_failed"] == 2


@pytest.mark.parametrize(("overrides", "message"), [
    (["workflow.type=custom", "workflow.path=nope.mod:f"],
     "workflow.path: cannot import module 'nope.mod'"),
    (["workflow.type=custom", "workflow.path=tests.unit.test_workflows:missing"],
     "workflow.path: module 'tests.unit.test_workflows' has no attribute 'missing'"),
    (["workflow.type=custom", "workflow.path=tests.unit.test_workflows:not_a_factory"],
     "workflow.path: 'tests.unit.test_workflows:not_a_factory' is neither an async"),
    (["workflow.type=multi_turn", "workflow.env=lookupp"],
     "workflow.env: 'lookupp' is neither a built-in env"),
    (["workflow.type=multi_turn", "workflow.env=tests.unit.test_workflows:Nope"],
     "workflow.env: module 'tests.unit.test_workflows' has no attribute 'Nope'"),
    (["workflow.type=multi_turn", "workflow.env=lookup", "workflow.env_args={bad=1}"],
     "workflow.env_args: 'lookup' rejected"),
])
def test_wrong_import_paths_name_the_config_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_workflow(load_config(None, overrides), TOKENIZER, 0)
    assert message in str(info.value)


def test_prompts_longer_than_the_limit_are_skipped_and_counted_never_cut() -> None:
    """``data.max_prompt_tokens``: a longer prompt never reaches the engine; each of its
    episodes is counted, and a prompt within the limit runs as it is."""
    cfg = load_config(None, ["workflow.type=single_turn", "workflow.chat_template=false",
                             "data.path=rows.jsonl", "data.max_prompt_tokens=8"])
    engine = ScriptedEngine(["7"], [0])
    runner = EpisodeRunner(make_workflow(cfg, TOKENIZER, 0), engine, 2)
    assert asyncio.run(runner.group(Sample("long", "123456789012"), 2)) is None
    assert runner.counts["episodes_prompt_too_long"] == 2 and engine.calls == 0
    assert runner.metrics()["rollout/episodes_prompt_too_long"] == 2
    group = asyncio.run(runner.group(Sample("short", "12"), 1))
    assert group is not None and engine.calls == 1
