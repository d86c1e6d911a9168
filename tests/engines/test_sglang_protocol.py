"""SglangEngine and SglangWeightPeer against a protocol fixture, because SGLang cannot be
installed on these CPU machines (it pins a CUDA torch build).

The fixture (``tests/engines/sglang_fixture.py``) is a real HTTP server on 127.0.0.1 that
validates every request body against the documented SGLang 0.5.x request schemas
(``python/sglang/srt/managers/io_struct.py``) and answers HTTP 400 on any violation; with
``join_groups`` it joins the learner's gloo group the way SGLang's ``init_custom_process_group``
does (torch's rendezvous and ``_new_process_group_helper``) and receives the broadcast. Here it
generates scripted tokens; ``test_sglang_run.py`` runs it with a real tiny model behind the
real learner and rollout worker, and ``test_sglang_real.py`` targets a real server.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from asyncrl.config.schema import BufferConfig, WeightsConfig, ZmqBufferConfig
from asyncrl.weights.broadcaster import WeightBroadcaster, broadcast_align, engine_weights
from asyncrl.weights.plan import BucketPlan, TensorSpec, plan_buckets
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from rollouters.engines.sglang_engine import (
    SglangEngine,
    SglangError,
    SglangTimeout,
    SglangWeightPeer,
    sglang_requests,
    token_versions,
)
from tests.engines.sglang_fixture import FakeSglang, serve


@contextmanager
def weight_sync(engine: SglangEngine, weights: WeightsConfig, member: str = "sglang-0",
                client_timeout_s: float = 10.0,
                ) -> Iterator[tuple[SglangWeightPeer, WeightBroadcaster]]:
    """The real broker, a learner's broadcaster and ``engine``'s peer (a member named
    ``member``, started); the buffer clients wait ``client_timeout_s`` per request."""
    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)),
                                               groups_per_step=1)
    learner = ZmqBufferClient(address, client_timeout_s)
    own = ZmqBufferClient(address, client_timeout_s)
    peer = SglangWeightPeer(own, member, engine)
    broadcaster = WeightBroadcaster(learner, weights, align=broadcast_align("sglang"))
    try:
        learner.heartbeat(member, "rollout", {})
        peer.start()
        yield peer, broadcaster
    finally:
        peer.stop()
        broadcaster.close()
        learner.close()
        own.close()
        stop_broker()


@pytest.fixture
def server() -> Iterator[tuple[str, FakeSglang]]:
    fake = FakeSglang()
    with serve(fake) as (url, _):
        yield url, fake


def test_generate_sends_token_ids_and_parses_logprobs(server) -> None:
    url, fake = server
    engine = SglangEngine(url, version=3)
    out = engine.generate([[1, 2], [5]], n=2, temperature=0.7, max_new_tokens=3)
    path, body = fake.calls[0]
    assert path == "/generate" and body["return_logprob"] is True
    assert body["input_ids"] == [[1, 2], [1, 2], [5], [5]]
    assert body["sampling_params"] == {"temperature": 0.7, "max_new_tokens": 3}
    assert [len(group) for group in out] == [2, 2]
    first = out[0][0]
    assert first.tokens == [3, 4, 5]
    assert first.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert first.versions == [3, 3, 3] and first.finish_reason == "length"
    assert out[1][1].tokens == [(5 + 3) % 50, 9, 10]


def test_the_models_eos_ids_are_sent_as_stop_token_ids(server) -> None:
    url, fake = server
    SglangEngine(url, eos_ids=(151645, 151643)).generate([[1]], n=1, temperature=1.0,
                                                         max_new_tokens=2)
    _, body = fake.calls[0]
    assert body["sampling_params"]["stop_token_ids"] == [151645, 151643]


def test_greedy_sends_temperature_zero(server) -> None:
    url, fake = server
    SglangEngine(url).generate([[1]], n=1, temperature=1.0, max_new_tokens=1, greedy=True)
    assert fake.calls[0][1]["sampling_params"]["temperature"] == 0.0


def test_pause_update_continue_order_and_version(server) -> None:
    url, fake = server
    engine = SglangEngine(url)
    engine.init_weights_update_group("127.0.0.1", 29500, 1, 2, "epoch1", "gloo")
    with engine.paused(), engine.weight_session():
        engine.update_weights_from_distributed(["a", "b"], ["float32", "bfloat16"],
                                               [[2, 2], [4]], "epoch1", flush_cache=True,
                                               weight_version="7", load_format="flattened_bucket")
    engine.set_version(7)
    engine.update_weight_version(7)
    assert [p for p, _ in fake.calls] == [
        "/init_weights_update_group", "/pause_generation", "/begin_weight_update",
        "/update_weights_from_distributed", "/end_weight_update", "/continue_generation",
        "/update_weight_version"]
    assert fake.calls[1][1] == {"mode": "retract"} and fake.calls[2][1] == {}
    assert fake.calls[6][1] == {"new_version": "7", "abort_all_requests": False}
    assert engine.version == 7 and fake.weight_version == "7"


def test_resume_even_when_update_fails(server) -> None:
    url, fake = server
    engine = SglangEngine(url)
    with pytest.raises(SglangError, match="HTTP 400.*shapes"), engine.paused(), \
            engine.weight_session():
        engine.update_weights_from_distributed(["a"], ["float32"], [["2"]], "g",
                                               flush_cache=False)
    assert [p for p, _ in fake.calls] == ["/pause_generation", "/begin_weight_update",
                                          "/end_weight_update", "/continue_generation"]
    assert not fake.session_open   # the next update can open one


def test_an_update_outside_a_session_is_refused_as_sglang_does(server) -> None:
    url, fake = server
    with pytest.raises(SglangError, match="must run between begin_weight_update"):
        SglangEngine(url).update_weights_from_distributed(["a"], ["float32"], [[1]], "g",
                                                          flush_cache=False)


def test_a_session_left_open_is_closed_and_an_older_sglang_needs_none(server, caplog) -> None:
    """A session a dead worker left open is closed before the next opens (warned); a server
    from before sessions (404) is asked once, then updates load without them."""
    url, fake = server
    fake.session_open = True
    engine = SglangEngine(url)
    engine.update(lambda: engine.update_weight_version(3))
    assert [p for p, _ in fake.calls][:4] == ["/pause_generation", "/begin_weight_update",
                                              "/end_weight_update", "/begin_weight_update"]
    assert "session was left open" in caplog.text and not fake.session_open
    fake.calls.clear()
    fake.sessions = False
    old = SglangEngine(url)
    for version in (4, 5):
        old.update(lambda: old.update_weights_from_distributed(
            ["a"], ["float32"], [[1]], "g", flush_cache=True, weight_version=str(version)))
    assert [p for p, _ in fake.calls] == [
        "/pause_generation", "/begin_weight_update", "/update_weights_from_distributed",
        "/continue_generation", "/pause_generation", "/update_weights_from_distributed",
        "/continue_generation"]
    assert fake.weight_version == "5"


def test_a_flush_while_requests_run_needs_a_retract_pause(server) -> None:
    """SGLang flushes its cache only with no request running: paused ``in_place`` (requests
    stay running) an update that flushes is refused after loading, so that engine asks for
    no flush; paused with ``retract`` (the default) the flush goes through."""
    url, fake = server
    fake.hold = True
    in_place, retract = SglangEngine(url, pause_mode="in_place"), SglangEngine(url)
    assert not in_place.flushes and retract.flushes
    call = threading.Thread(target=lambda: retract.generate([[1]], 1, 1.0, 2))
    call.start()
    assert fake.arrived.wait(timeout=10)
    with pytest.raises(SglangError, match="cache was not flushed"):
        in_place.update(lambda: in_place.update_weights_from_distributed(
            ["a"], ["float32"], [[1]], "g", flush_cache=True))
    in_place.update(lambda: in_place.update_weights_from_distributed(
        ["a"], ["float32"], [[1]], "g", flush_cache=in_place.flushes))
    retract.update(lambda: retract.update_weights_from_distributed(
        ["a"], ["float32"], [[1]], "g", flush_cache=retract.flushes))
    fake.release.set()
    call.join(10)
    assert not call.is_alive() and not fake.session_open


@pytest.mark.parametrize("spans", [True, False])
def test_update_during_generate_marks_older_version(server, spans: bool) -> None:
    """A request that overlaps an update: with SGLang's ``weight_versions`` spans each token
    gets its span's version (the fixture puts the update half-way; the initial weights'
    ``default`` takes the version at submission); without them (an older SGLang) every
    token gets the version it started with (the older)."""
    url, fake = server
    fake.spans = spans
    engine = SglangEngine(url, version=1)
    fake.hold = True
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(
        engine.generate([[2]], n=1, temperature=1.0, max_new_tokens=2)))
    worker.start()
    assert fake.arrived.wait(timeout=10)
    with engine.paused(), engine.weight_session():   # retract: the flush goes through
        engine.update_weights_from_distributed(["a"], ["float32"], [[1]], "g", True, "2")
    engine.set_version(2)
    fake.release.set()
    worker.join(timeout=10)
    assert result[0][0][0].versions == ([1, 2] if spans else [1, 1])
    assert engine.generate([[2]], 1, 1.0, 2)[0][0].versions == [2, 2]


def test_span_versions_never_pass_the_engines_own() -> None:
    meta = {"weight_versions": [{"version": "default", "start": 0, "end": 2},
                                {"version": "4", "start": 2, "end": 4},
                                {"version": "9", "start": 4, "end": 9}]}
    assert token_versions(meta, 6, version=3, newest=5) == [3, 3, 4, 4, 5, 5]
    assert token_versions({}, 2, version=3, newest=5) == [3, 3]


def test_timeout_raises_clearly(server) -> None:
    url, fake = server
    fake.hold = True
    engine = SglangEngine(url, generate_timeout_s=0.2)
    with pytest.raises(SglangTimeout, match="/generate: no answer within 0.2s"):
        engine.generate([[1]], n=1, temperature=1.0, max_new_tokens=1)


def test_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(SglangError, match="unreachable"):
        SglangEngine("http://127.0.0.1:9", timeout_s=2).resume()


def test_schema_violation_surfaces(server) -> None:
    url, _ = server
    engine = SglangEngine(url)
    with pytest.raises(SglangError, match="HTTP 400.*unknown field bogus"):
        engine._post("/pause_generation", {"bogus": 1}, 5.0)
    with pytest.raises(SglangError, match="master_port"):
        engine._post("/init_weights_update_group", {
            "master_address": "h", "master_port": "1", "rank_offset": 1, "world_size": 2}, 5.0)


def test_load_weights_points_to_the_peer(server) -> None:
    with pytest.raises(NotImplementedError, match="SglangWeightPeer"):
        SglangEngine(server[0]).load_weights([], 1)


def test_bucket_requests_need_an_unpadded_plan() -> None:
    packed = BucketPlan((TensorSpec("a", (4,), "float32", 0, 0, 16),
                         TensorSpec("b", (2, 2), "bfloat16", 0, 16, 8)), (24,))
    assert sglang_requests(packed) == [{"names": ["a", "b"], "dtypes": ["float32", "bfloat16"],
                                        "shapes": [[4], [2, 2]]}]
    padded = BucketPlan((TensorSpec("a", (1,), "float32", 0, 0, 4),
                         TensorSpec("b", (1,), "float32", 0, 16, 4)), (20,))
    with pytest.raises(ValueError, match="without alignment"):
        sglang_requests(padded)
    odd = BucketPlan((TensorSpec("a", (3,), "bfloat16", 0, 0, 6),
                      TensorSpec("b", (1,), "float32", 0, 6, 4)), (10,))
    with pytest.raises(ValueError, match="b \\(float32\\) at byte 6, misaligned"):
        sglang_requests(odd)


def test_unpadded_plans_never_misalign_a_tensor_for_its_dtype() -> None:
    """SGLang 0.5.23 refuses a tensor misaligned for its dtype in a flattened bucket: an fp32
    tensor after a bf16 one of odd size opens a new bucket instead."""
    state = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2),
             "c": torch.zeros(5, dtype=torch.bfloat16), "d": torch.zeros(1, dtype=torch.int8),
             "e": torch.zeros(3, dtype=torch.bfloat16)}
    plan = plan_buckets(state, bucket_bytes=1 << 20, align=1)
    assert [(s.name, s.bucket, s.offset) for s in plan.tensors] == [
        ("a", 0, 0), ("b", 1, 0), ("c", 1, 8), ("d", 1, 18), ("e", 2, 0)]
    assert [r["names"] for r in sglang_requests(plan)] == [["a"], ["b", "c", "d"], ["e"]]


@pytest.mark.parametrize("pause_mode", ["retract", "in_place"])
def test_weight_peer_follows_the_real_broadcaster(server, pause_mode: str) -> None:
    """The peer's handshake, group join and per-bucket requests against the real
    WeightBroadcaster and broker; the fixture joins the group through torch's own
    rendezvous and group helper (as SGLang does) and receives the buckets over gloo, in a
    weight-update session. Two versions: the group is reused; the peer's stop makes the
    server drop it. Paused in place, the last bucket asks for no cache flush."""
    url, fake = server
    fake.join_groups = True
    engine = SglangEngine(url, update_timeout_s=20.0, pause_mode=pause_mode)
    with weight_sync(engine, WeightsConfig(bucket_mb=0.0001, timeout_s=10)) as parts:
        peer, broadcaster = parts
        state = {"a": torch.randn(4, 4), "b": torch.randn(8).to(torch.bfloat16),
                 "c": torch.randn(2, 16)}
        metrics = broadcaster.sync(state, version=5)
        assert metrics["weights/members"] == 1 and metrics["weights/buckets"] == 2
        assert peer.wait_for_version(5, timeout=10) and engine.version == 5
        assert set(fake.received) == set(state)
        for name, tensor in state.items():
            assert torch.equal(fake.received[name], tensor)
        paths = [p for p, _ in fake.calls]
        assert paths == ["/init_weights_update_group", "/pause_generation",
                         "/begin_weight_update", "/update_weights_from_distributed",
                         "/update_weights_from_distributed", "/end_weight_update",
                         "/continue_generation"]
        updates = [b for p, b in fake.calls if p == "/update_weights_from_distributed"]
        assert [u["flush_cache"] for u in updates] == [False, pause_mode == "retract"]
        assert updates[-1]["weight_version"] == "5"
        assert updates[0]["group_name"] == fake.calls[0][1]["group_name"]
        assert list(fake.groups) == [updates[0]["group_name"]]
        assert len(peer.pause_s) == 1
        state = {name: tensor * 2 for name, tensor in state.items()}
        broadcaster.sync(state, version=6)
        assert peer.wait_for_version(6, timeout=10) and fake.weight_version == "6"
        assert all(torch.equal(fake.received[name], t) for name, t in state.items())
        assert [p for p, _ in fake.calls].count("/init_weights_update_group") == 1
        peer.stop()
        assert fake.groups == {} and fake.calls[-1][0] == "/destroy_weights_update_group"


def test_an_update_the_model_does_not_fit_is_refused_before_the_server_joins(server) -> None:
    """With the model's shapes known (the factory passes them), the peer checks the update's
    manifest before anything: a tensor of another shape is refused, the server is never asked
    to join or load (a refusal of its own, bucket by bucket, could leave the update partial),
    and the peer serves no more (the rollout worker stops on :attr:`refused`)."""
    from asyncrl.weights.fit import WeightsRefused

    url, fake = server
    fake.join_groups = True
    engine = SglangEngine(url, update_timeout_s=20.0, shapes={"a": (4, 4), "c": (2, 8)})
    with weight_sync(engine, WeightsConfig(bucket_mb=0.0001, timeout_s=2)) as parts:
        peer, broadcaster = parts
        metrics = broadcaster.sync({"a": torch.randn(4, 4), "c": torch.randn(2, 16)}, 5)
        assert metrics["weights/members"] == 0, metrics
        assert not peer.wait_for_version(5, timeout=10)
        assert isinstance(peer.refused, WeightsRefused)
        assert "c: shape (2, 16) does not match (2, 8)" in str(peer.refused)
        assert [p for p, _ in fake.calls] == [] and engine.version == 0


def test_make_engine_attaches_to_url_and_picks_the_peer(server, tmp_path) -> None:
    """``rollout.engine = "sglang"`` with ``rollout.url``: one server per worker, and the
    worker's weight receiver is the peer (the server receives the broadcast itself)."""
    from asyncrl.config import load_config
    from asyncrl.weights.receiver import WeightReceiver
    from rollouters.engines import make_engine, make_weight_receiver

    url, _ = server
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "rollout.engine=sglang",
                             f"rollout.url={url}", "rollout.workers=1"])
    from asyncrl.models import EOS_ID, prepare_model_dir
    from asyncrl.tokens import ModelTokenizer

    model_dir = prepare_model_dir(cfg.model, tmp_path, 0)
    engine = make_engine(cfg, model_dir, 0, ModelTokenizer(model_dir))
    assert isinstance(engine, SglangEngine) and engine.url == url
    assert engine.eos_ids == (EOS_ID,)   # the model's own, sent as stop_token_ids
    assert engine.shapes is not None and "lm_head.weight" in engine.shapes  # updates fit them
    assert engine.pause_mode == "retract" and engine.flushes
    in_place = make_engine(load_config(None, [
        f"run.output_dir={tmp_path}", "rollout.engine=sglang", f"rollout.url={url}",
        "rollout.workers=1", "rollout.sglang.pause_mode=in_place"]), model_dir, 0,
        ModelTokenizer(model_dir))
    assert in_place.pause_mode == "in_place" and not in_place.flushes
    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)),
                                               groups_per_step=1)
    control = ZmqBufferClient(address, 10.0)
    try:
        assert isinstance(make_weight_receiver(engine, control, "m"), SglangWeightPeer)
        assert type(make_weight_receiver(object(), control, "m")) is WeightReceiver
    finally:
        control.close()
        stop_broker()
    with pytest.raises(ValueError, match="rollout.workers = 2 but rollout.url names 1"):
        load_config(None, [f"run.output_dir={tmp_path}", "rollout.engine=sglang",
                           f"rollout.url={url}", "rollout.workers=2"])  # checked by the config


def test_sglang_plans_pack_every_tensor() -> None:
    """SGLang gets one HTTP request per bucket: large tensors are not sent alone for it."""
    cfg = WeightsConfig(alone_mb=1.0)
    assert engine_weights(cfg, "sglang").alone_mb == 0.0
    assert engine_weights(cfg, "torch") is cfg and broadcast_align("torch") == 16
    assert broadcast_align("sglang") == 1


def test_sleep_defers_an_update_to_the_wake_and_generates_the_new_weights(
        tiny_model_dir, reference_state: dict) -> None:
    """``launcher.colocate`` with SGLang's memory saver, against the fixture serving a tiny
    model: sleep releases the weights and KV cache; a generate call made asleep waits; an
    update broadcast while asleep waits too (the server receives it itself: nothing to hold
    here) and runs at the wake between the resume of the weights and of the KV cache; the
    waiting call then returns the new weights' greedy tokens, labelled with their version."""
    from tests.engines.test_vllm_engine import PROMPTS, _flat, _patched, _reference_engine

    fake = FakeSglang(str(tiny_model_dir), join_groups=True)
    patched = _patched(reference_state)
    with serve(fake) as (url, _):
        engine = SglangEngine(url, update_timeout_s=30.0)
        with weight_sync(engine, WeightsConfig(bucket_mb=1.0, timeout_s=30)) as (_, sender):
            engine.sleep()
            assert engine.asleep and fake.released == {"weights", "kv_cache"}
            result: list[Any] = []
            call = threading.Thread(target=lambda: result.append(engine.generate(
                PROMPTS, n=1, temperature=1.0, max_new_tokens=6, greedy=True)))
            call.start()
            sync = threading.Thread(target=lambda: sender.sync(patched, version=1))
            sync.start()
            sync.join(1.0)
            assert call.is_alive() and sync.is_alive()  # both wait for the wake
            assert engine.version == 0 and fake.received == {}
            engine.wake_up()
            sync.join(30)
            call.join(30)
            assert not sync.is_alive() and not call.is_alive() and not engine.asleep
    assert engine.version == 1 and fake.released == set()
    paths = [p for p, _ in fake.calls if p not in ("/init_weights_update_group",
                                                   "/destroy_weights_update_group")]
    assert paths[:2] == ["/release_memory_occupation", "/resume_memory_occupation"]
    assert paths[-2:] == ["/resume_memory_occupation", "/generate"]
    # no pause (asleep), a session around the buckets
    assert paths[2] == "/begin_weight_update" and paths[-3] == "/end_weight_update"
    assert set(paths[3:-3]) == {"/update_weights_from_distributed"}
    tags = [b["tags"] for p, b in fake.calls if "memory_occupation" in p]
    assert tags == [["weights", "kv_cache"], ["weights"], ["kv_cache"]]
    expected = _flat(_reference_engine(tiny_model_dir, patched).generate(
        PROMPTS, 1, 1.0, 6, greedy=True))
    got = _flat(result[0])
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    assert all(c.versions == [1] * len(c.tokens) for c in got)


def test_a_sleep_waits_for_the_call_in_flight_and_an_update_awake_pauses(server) -> None:
    """The fixture refuses a release while a request runs (SGLang's scheduler must be idle):
    the sleep waits for this engine's call; awake, an update is paused around as before."""
    url, fake = server
    engine = SglangEngine(url)
    fake.hold = True
    call = threading.Thread(target=lambda: engine.generate([[1]], 1, 1.0, 2))
    call.start()
    assert fake.arrived.wait(timeout=10)
    asleep = threading.Thread(target=engine.sleep)
    asleep.start()
    asleep.join(0.3)
    assert asleep.is_alive() and engine.asleep  # closed to new calls, waiting for this one
    fake.release.set()
    call.join(10)
    asleep.join(10)
    assert [p for p, _ in fake.calls] == ["/generate", "/release_memory_occupation"]
    engine.wake_up()
    fake.calls.clear()
    engine.update(lambda: engine.update_weight_version(3))
    assert [p for p, _ in fake.calls] == ["/pause_generation", "/begin_weight_update",
                                          "/update_weight_version", "/end_weight_update",
                                          "/continue_generation"]


def test_an_update_no_wake_comes_for_is_withdrawn_naming_the_key(server) -> None:
    url, fake = server
    engine = SglangEngine(url, update_timeout_s=0.1)
    engine.sleep()
    with pytest.raises(SglangTimeout, match="weights.timeout_s"):
        engine.update(lambda: engine.update_weight_version(3))
    engine.wake_up()  # nothing left to run
    assert [p for p, _ in fake.calls] == ["/release_memory_occupation",
                                          "/resume_memory_occupation",
                                          "/resume_memory_occupation"]
