"""TorchEngine: KV-cached sampling matches a full forward; weights swap between decode steps."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from asyncrl.config.schema import TinyModelConfig  # noqa: E402
from asyncrl.models import EOS_ID, PAD_ID, VOCAB, build_tiny_model  # noqa: E402
from asyncrl.weights.fit import WeightsRefused  # noqa: E402
from rollouters.engines.base import Engine  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402

torch.set_num_threads(1)

PROMPTS = [[1, 5, 6, 7, 8, 2], [1, 9, 2], [1, 4, 13, 12, 11, 10, 9, 8, 2]]  # unequal lengths


def _model(seed: int = 0) -> torch.nn.Module:
    return build_tiny_model(TinyModelConfig(), len(VOCAB), seed)


def _engine(seed: int = 0, **kwargs) -> TorchEngine:
    return TorchEngine(_model(seed), eos_ids=(EOS_ID,), pad_id=PAD_ID, seed=0, **kwargs)


def _bias_logit(engine: TorchEngine, token: int, amount: float) -> None:
    """Shift one token's logit (a forward hook on ``lm_head``; parameter names unchanged)."""
    engine.model.lm_head.register_forward_hook(
        lambda _module, _inputs, logits: logits + amount * torch.eye(len(VOCAB))[token])


def _full_forward_logprobs(model, prompt: list[int], tokens: list[int],
                           temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_is_an_engine() -> None:
    assert isinstance(_engine(), Engine)


def test_shapes_and_finish_reasons() -> None:
    engine = _engine()
    out = engine.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=6)
    assert [len(group) for group in out] == [4, 4, 4]
    for completion in (c for group in out for c in group):
        n = len(completion.tokens)
        assert 1 <= n <= 6 and len(completion.logprobs) == n == len(completion.versions)
        assert completion.versions == [0] * n
        if completion.finish_reason == "stop":
            assert completion.tokens[-1] == EOS_ID and EOS_ID not in completion.tokens[:-1]
        else:
            assert completion.finish_reason == "length" and n == 6
            assert EOS_ID not in completion.tokens


def test_stops_at_eos() -> None:
    engine = _engine()
    _bias_logit(engine, EOS_ID, 100.0)
    out = engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=8)
    assert all(c.tokens == [EOS_ID] and c.finish_reason == "stop" for g in out for c in g)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_full_forward(temperature: float) -> None:
    engine = _engine()
    _bias_logit(engine, EOS_ID, 0.7)  # some rows finish early and ride along padded
    out = engine.generate(PROMPTS, n=4, temperature=temperature, max_new_tokens=10)
    reasons = {c.finish_reason for g in out for c in g}
    assert reasons == {"stop", "length"}
    for prompt, group in zip(PROMPTS, out):
        for completion in group:
            expected = _full_forward_logprobs(engine.model, prompt, completion.tokens,
                                              temperature)
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected,
                                       atol=1e-4, rtol=0)


def test_greedy_is_deterministic_and_scored_at_temperature_one() -> None:
    engine = _engine()
    first = engine.generate(PROMPTS, n=2, temperature=0.3, max_new_tokens=8, greedy=True)
    second = _engine().generate(PROMPTS, n=2, temperature=0.3, max_new_tokens=8, greedy=True)
    assert first == second
    for prompt, (a, b) in zip(PROMPTS, first):
        assert a.tokens == b.tokens
        expected = _full_forward_logprobs(engine.model, prompt, a.tokens, 1.0)
        torch.testing.assert_close(torch.tensor(a.logprobs), expected, atol=1e-4, rtol=0)


def test_load_weights_changes_outputs_and_version() -> None:
    engine, other = _engine(seed=0), _engine(seed=1)
    before = engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True)
    engine.load_weights(other.state_dict().items(), version=5)
    after = engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True)
    assert engine.version == 5
    assert after != before
    reference = other.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True)
    assert [c.tokens for g in after for c in g] == [c.tokens for g in reference for c in g]
    assert all(c.versions == [5] * len(c.tokens) for g in after for c in g)


def test_tied_embedding_loads_through_either_name() -> None:
    engine, other = _engine(seed=0), _engine(seed=1)
    embed = other.state_dict()["model.embed_tokens.weight"]
    engine.load_weights([("model.embed_tokens.weight", embed)], version=1)
    assert torch.equal(engine.state_dict()["lm_head.weight"], embed)


def test_unknown_weight_name_raises_and_changes_nothing() -> None:
    engine = _engine()
    before = engine.state_dict()
    bad = [("model.norm.weight", torch.zeros_like(before["model.norm.weight"])),
           ("no.such.weight", torch.zeros(3))]
    with pytest.raises(WeightsRefused, match="no.such.weight"):
        engine.load_weights(bad, version=9)
    assert engine.version == 0
    assert torch.equal(engine.state_dict()["model.norm.weight"], before["model.norm.weight"])


def test_adopt_weights_takes_the_tensors_without_a_copy() -> None:
    """The zero-copy commit: parameters become the given tensors (same storage), outputs are
    the new model's; a tensor of another dtype is copied instead; a bad name changes nothing."""
    engine, other = _engine(seed=0), _engine(seed=1)
    new = other.state_dict()
    new["model.norm.weight"] = new["model.norm.weight"].double()  # cannot be the parameter
    engine.adopt_weights(new, version=3)
    params = dict(engine.model.named_parameters())
    assert params["model.layers.0.mlp.up_proj.weight"].data_ptr() == \
        new["model.layers.0.mlp.up_proj.weight"].data_ptr()
    norm = params["model.norm.weight"]
    assert norm.dtype == torch.float32 and norm.data_ptr() != new["model.norm.weight"].data_ptr()
    assert torch.equal(norm, new["model.norm.weight"].float())
    got = engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True)
    reference = other.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True)
    assert [c.tokens for g in got for c in g] == [c.tokens for g in reference for c in g]
    assert engine.version == 3
    with pytest.raises(WeightsRefused, match="no.such.weight"):
        engine.adopt_weights({"model.norm.weight": torch.zeros(norm.shape),
                              "no.such.weight": torch.zeros(3)}, version=4)
    assert engine.version == 3 and torch.equal(params["model.norm.weight"],
                                               new["model.norm.weight"].float())


def test_load_from_another_thread_between_decode_steps() -> None:
    new_weights = _engine(seed=1).state_dict()
    holder: dict[str, TorchEngine] = {}

    def on_step(step: int) -> None:
        if step == 2:  # a receiver thread lands an update mid-generation
            loader = threading.Thread(
                target=holder["engine"].load_weights, args=(new_weights.items(), 1))
            loader.start()
            loader.join()

    engine = holder["engine"] = _engine(on_step=on_step)
    _bias_logit(engine, EOS_ID, -100.0)  # no early EOS, so every sequence sees the update
    out = engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=6)
    assert engine.version == 1
    for completion in (c for g in out for c in g):
        assert completion.versions == [0, 0, 0, 1, 1, 1]
        assert completion.versions == sorted(completion.versions)


def test_rejects_bad_arguments() -> None:
    engine = _engine()
    with pytest.raises(ValueError):
        engine.generate([], n=1, temperature=1.0, max_new_tokens=4)
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=4)
