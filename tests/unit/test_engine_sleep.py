"""TorchEngine sleep and wake (``launcher.colocate``): real moves of memory, nothing lost.

Asleep, the engine holds no parameter storage and no KV cache; its weights wait in host
copies, and a weight update that comes meanwhile lands there. Awake again, it samples exactly
what it would have sampled without the nap.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading  # noqa: E402

import torch  # noqa: E402

from asyncrl.config.schema import TinyModelConfig  # noqa: E402
from asyncrl.models import EOS_ID, PAD_ID, VOCAB, build_tiny_model  # noqa: E402
from rollouters.engines.base import Sleeper  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402

torch.set_num_threads(1)

PROMPTS = [[1, 5, 6, 7, 8, 2], [1, 9, 2]]


def _engine(seed: int = 0, **kwargs) -> TorchEngine:
    model = build_tiny_model(TinyModelConfig(), len(VOCAB), seed)
    return TorchEngine(model, eos_ids=(EOS_ID,), pad_id=PAD_ID, seed=0, **kwargs)


def _storages(engine: TorchEngine) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in engine.model.parameters()}


def test_sleep_releases_weights_and_kv_cache_and_wake_restores_them() -> None:
    during: list[dict[str, int]] = []
    engine = _engine(on_step=lambda step: during.append(engine.memory()))
    assert isinstance(engine, Sleeper)
    before = engine.state_dict()
    awake = engine.memory()
    engine.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=6)
    assert during and all(m["kv_bytes"] > 0 for m in during)   # the cache of the call in flight
    held = [p.data for p in engine.model.parameters()]   # kept alive: no address reuse

    engine.sleep()
    asleep = engine.memory()
    assert engine.asleep
    assert asleep["weights_bytes"] == 0 and asleep["kv_bytes"] == 0
    assert asleep["host_bytes"] == awake["weights_bytes"] > 0
    assert all(p.numel() == 0 for p in engine.model.parameters())

    engine.wake_up()
    assert not engine.asleep
    assert engine.memory() == awake
    # new storage: the weights really moved out and back
    assert not _storages(engine) & {t.untyped_storage().data_ptr() for t in held}
    after = engine.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_nap_changes_no_sample() -> None:
    rested, napped = _engine(), _engine()
    napped.sleep()
    napped.wake_up()
    for _ in range(2):
        a = rested.generate(PROMPTS, n=3, temperature=1.0, max_new_tokens=6)
        b = napped.generate(PROMPTS, n=3, temperature=1.0, max_new_tokens=6)
        assert [[c.tokens for c in g] for g in a] == [[c.tokens for c in g] for g in b]
        napped.sleep()
        napped.wake_up()


def test_sleep_waits_for_the_call_in_flight_and_generate_waits_for_the_wake() -> None:
    mid_call, may_go = threading.Event(), threading.Event()

    def hold(step: int) -> None:
        if step == 1:
            mid_call.set()
            may_go.wait(30)

    engine = _engine(on_step=hold)
    results: list[object] = []
    first = threading.Thread(target=lambda: results.append(
        engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=4)))
    first.start()
    assert mid_call.wait(30)
    slept = threading.Event()
    sleeper = threading.Thread(target=lambda: (engine.sleep(), slept.set()))
    sleeper.start()
    assert not slept.wait(0.2)          # the call in flight holds its weights and cache
    engine.on_step = None
    may_go.set()
    first.join(30)
    assert slept.wait(30) and results   # ... until it returned
    assert engine.memory()["kv_bytes"] == 0

    second_done = threading.Event()
    second = threading.Thread(target=lambda: (engine.generate(PROMPTS, n=1, temperature=1.0,
                                                              max_new_tokens=2),
                                              second_done.set()))
    second.start()
    assert not second_done.wait(0.2)    # asleep: a new call waits for the wake
    engine.wake_up()
    assert second_done.wait(30)
    second.join(30)
    sleeper.join(30)


def test_weights_loaded_while_asleep_are_there_after_the_wake() -> None:
    engine, source = _engine(seed=0), _engine(seed=1)
    update = source.state_dict()
    engine.sleep()
    engine.adopt_weights(dict(update), version=3)   # the receiver's zero-copy commit
    assert engine.memory()["weights_bytes"] == 0      # still asleep: nothing on the device
    engine.wake_up()
    assert engine.version == 3
    after = engine.state_dict()
    assert all(torch.equal(after[k], update[k]) for k in update)

    engine.sleep()
    engine.load_weights(_engine(seed=2).state_dict().items(), version=4)
    engine.wake_up()
    expected = _engine(seed=2).state_dict()
    assert all(torch.equal(engine.state_dict()[k], expected[k]) for k in expected)
