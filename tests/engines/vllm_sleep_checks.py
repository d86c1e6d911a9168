"""The vLLM engines' sleep and wake (``launcher.colocate``), against a real vLLM on CPU: checks
run on each mode's engine by ``test_vllm_engine`` (in-process), ``test_vllm_async`` and
``test_vllm_server`` (over HTTP), on the engine each module has started already
(``sleep_mode`` changes nothing on CPU).

vLLM's sleep frees nothing on CPU (its CPU worker's ``sleep``/``wake_up`` are logged no-ops,
and ``enable_sleep_mode`` is refused there), so this tests our sequence around it, with vLLM's
own bookkeeping (``is_sleeping``): a call made asleep waits for the wake, an update that
arrives asleep is held and applied at the wake, and what the engine generates after it is the
new weights'. The memory release itself is GPU-only and untested here (``vllm_sleep``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from asyncrl.models import load_causal_lm

STEPS = 6
WAITED_S = 0.5  # how long a generate call made asleep is seen not to return


def _vllm_sleeping(engine) -> bool:
    """vLLM's own word: is its engine core asleep (scheduler paused or memory released)?"""
    if hasattr(engine, "url"):  # a server: its dev route
        import json
        import urllib.request

        with urllib.request.urlopen(f"{engine.url}/is_sleeping", timeout=30) as answer:
            return bool(json.loads(answer.read())["is_sleeping"])
    llm = getattr(engine, "_llm", None)
    if llm is not None:
        return engine._run(llm.is_sleeping())
    return engine._engine.is_sleeping()


def check_update_while_asleep_lands_at_the_wake(engine, tiny_model_dir: Path,
                                                reference_state: dict) -> None:
    """sleep → a generate call (it waits) → an update (held) → wake: the call returns rows
    of the new version whose greedy tokens and logprobs are the new weights'."""
    from rollouters.engines.base import Sleeper
    from tests.engines.test_vllm_async import _greedy
    from tests.engines.test_vllm_engine import PROMPTS, _flat, _patched

    assert isinstance(engine, Sleeper)
    awake = engine.memory()
    assert awake["weights_bytes"] > 0 and awake["kv_bytes"] > 0
    old, new = engine.version, engine.version + 1
    patched = _patched(reference_state)

    engine.sleep()
    assert engine.asleep and _vllm_sleeping(engine)
    result: list = []
    call = threading.Thread(target=lambda: result.append(engine.generate(
        PROMPTS, n=1, temperature=1.0, max_new_tokens=STEPS, greedy=True)))
    call.start()
    call.join(WAITED_S)
    assert call.is_alive() and not result  # asleep: the call waits for the wake

    engine.load_weights(patched.items(), version=new)  # returns at once: held for the wake
    assert engine.version == old
    asleep = engine.memory()
    # on CPU vLLM's sleep frees nothing, and the engine says so; the update waits on host
    assert asleep["sleep_frees_memory"] == 0
    assert asleep["weights_bytes"] == awake["weights_bytes"]
    assert asleep["host_bytes"] >= sum(t.numel() * t.element_size()
                                       for t in patched.values()) > 0

    engine.wake_up()
    call.join(120)
    assert not call.is_alive() and not engine.asleep and not _vllm_sleeping(engine)
    assert engine.version == new and engine.memory() == awake
    assert torch.equal(engine.weight("model.norm.weight"), patched["model.norm.weight"])
    model = load_causal_lm(tiny_model_dir)
    model.load_state_dict(patched)
    for prompt, row in zip(PROMPTS, _flat(result[0])):
        assert row.versions == [new] * STEPS
        want, logprobs = _greedy(model, prompt, STEPS)
        assert row.tokens == want
        assert float((torch.tensor(row.logprobs) - torch.tensor(logprobs)).abs().max()) < 1e-3

    engine.load_weights(reference_state.items(), version=new + 1)  # awake: applied at once
    assert torch.equal(engine.weight("model.norm.weight"), reference_state["model.norm.weight"])


def check_a_sleep_without_an_update_wakes_with_the_same_weights(engine) -> None:
    """Level 1: the weights wait in host memory, so a wake with no update (one step off, an
    evicted engine) generates as before the sleep."""
    from tests.engines.test_vllm_engine import PROMPTS, _flat
    before = engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=STEPS, greedy=True)
    version = engine.version
    engine.sleep()
    engine.wake_up()
    after = engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=STEPS, greedy=True)
    assert engine.version == version
    for a, b in zip(_flat(before), _flat(after)):
        assert a.tokens == b.tokens and a.versions == b.versions
        assert float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max()) < 1e-5
