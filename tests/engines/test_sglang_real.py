"""SglangEngine against a real SGLang server (GPU machines only: SGLang does not install on
the CPU machines, where ``test_sglang_protocol.py`` covers the protocol with a fixture).

Set ``ASYNCRL_SGLANG_URL`` (e.g. ``http://127.0.0.1:30000``) to a server launched with
``python -m sglang.launch_server --model-path <model> --skip-tokenizer-init --tp-size 1``
(token ids in and out), and ``ASYNCRL_SGLANG_MODEL`` to that model's directory for the weight
sync test. Everything is skipped otherwise. Not run yet: no SGLang server was available to the
session that wrote it (the same protocol runs against the fixture in CI).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from rollouters.engines.sglang_engine import SglangEngine

URL = os.environ.get("ASYNCRL_SGLANG_URL", "")
MODEL = os.environ.get("ASYNCRL_SGLANG_MODEL", "")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.skipif(not URL, reason="ASYNCRL_SGLANG_URL not set (no SGLang server)"),
]


@pytest.fixture
def engine() -> SglangEngine:
    return SglangEngine(URL, timeout_s=30.0, generate_timeout_s=120.0)


def test_generate_returns_ids_and_logprobs(engine: SglangEngine) -> None:
    out = engine.generate([[1, 2, 3], [4, 5]], n=2, temperature=1.0, max_new_tokens=4)
    assert [len(group) for group in out] == [2, 2]
    for group in out:
        for completion in group:
            assert 1 <= len(completion.tokens) <= 4
            assert len(completion.logprobs) == len(completion.tokens)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in completion.logprobs)
            assert completion.versions == [engine.version] * len(completion.tokens)
            assert completion.finish_reason in ("stop", "length")


def test_greedy_is_deterministic(engine: SglangEngine) -> None:
    first = engine.generate([[7, 8, 9]], n=1, temperature=1.0, max_new_tokens=4, greedy=True)
    again = engine.generate([[7, 8, 9]], n=1, temperature=1.0, max_new_tokens=4, greedy=True)
    assert first[0][0].tokens == again[0][0].tokens


def test_pause_continue_and_version_label(engine: SglangEngine) -> None:
    with engine.paused():
        engine.update_weight_version(engine.version + 1)
    engine.set_version(engine.version + 1)
    out = engine.generate([[1, 2]], n=1, temperature=1.0, max_new_tokens=2)
    assert out[0][0].versions == [engine.version] * len(out[0][0].tokens)


@pytest.mark.skipif(not MODEL, reason="ASYNCRL_SGLANG_MODEL not set (the server's model dir)")
def test_weight_sync_through_the_broadcast_group(engine: SglangEngine) -> None:
    """The real learner broadcaster and the peer: zeroed weights make every logit equal
    (greedy picks token 0), the original weights bring the original output back."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config.schema import WeightsConfig
    from tests.engines.test_sglang_protocol import weight_sync

    state = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype="auto").state_dict()
    prompt = [[7, 8, 9]]
    before = engine.generate(prompt, 1, 1.0, 4, greedy=True)[0][0].tokens
    with weight_sync(engine, WeightsConfig(timeout_s=120), member="sglang-real",
                     client_timeout_s=30.0) as (peer, broadcaster):
        broadcaster.sync({k: torch.zeros_like(v) for k, v in state.items()}, version=1)
        assert peer.wait_for_version(1, timeout=120)
        assert engine.generate(prompt, 1, 1.0, 4, greedy=True)[0][0].tokens == [0] * 4
        broadcaster.sync(state, version=2)
        assert peer.wait_for_version(2, timeout=120)
        assert engine.generate(prompt, 1, 1.0, 4, greedy=True)[0][0].tokens == before
