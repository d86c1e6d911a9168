"""SglangEngine against a protocol fixture, because SGLang cannot be installed on these CPU
machines (it pins a CUDA torch build; see ``notes/vllm-cpu.md``).

The fixture is a real HTTP server on 127.0.0.1 (stdlib ``http.server`` in a thread). It checks
every request body against the documented SGLang 0.5.x request schemas
(``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput`` and its sampling params,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``PauseGenerationReqInput``, ``ContinueGenerationReqInput``, ``UpdateWeightVersionReqInput``):
required fields, field types, and no unknown fields (HTTP 400 otherwise). It answers with the
documented response shapes and records every call. The same tests against a real server live
in ``test_sglang_real.py``.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from asyncrl.config.schema import BufferConfig, WeightsConfig
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from learners.weights import WeightBroadcaster
from learners.weights_group import broadcast, dial_store, new_group
from learners.weights_plan import BucketPlan, TensorSpec
from rollouters.engines.sglang_engine import (
    SglangEngine,
    SglangError,
    SglangTimeout,
    SglangWeightPeer,
    sglang_requests,
)

INT, STR, BOOL, NUM = (int,), (str,), (bool,), (int, float)
OPT_STR = (str, type(None))

# path → (required fields, optional fields); a type tuple, or a callable check
SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "/generate": ({}, {
        "input_ids": lambda v: isinstance(v, list) and all(
            isinstance(row, list) and row and all(type(t) is int for t in row) for row in v),
        "sampling_params": dict, "return_logprob": BOOL, "rid": STR, "stream": BOOL,
        "return_text_in_logprobs": BOOL, "logprob_start_len": INT, "top_logprobs_num": INT}),
    "/init_weights_update_group": (
        {"master_address": STR, "master_port": INT, "rank_offset": INT, "world_size": INT},
        {"group_name": STR, "backend": STR}),
    "/update_weights_from_distributed": (
        {"names": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
         "dtypes": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
         "shapes": lambda v: isinstance(v, list) and all(
             isinstance(s, list) and all(type(d) is int for d in s) for s in v)},
        {"group_name": STR, "flush_cache": BOOL, "abort_all_requests": BOOL,
         "weight_version": OPT_STR, "load_format": OPT_STR, "torch_empty_cache": BOOL}),
    "/pause_generation": ({}, {"mode": lambda v: v in ("abort", "retract", "in_place")}),
    "/continue_generation": ({}, {"torch_empty_cache": BOOL}),
    "/update_weight_version": ({"new_version": STR}, {"abort_all_requests": BOOL}),
}
SAMPLING = {"temperature": NUM, "max_new_tokens": INT, "n": INT, "top_p": NUM, "top_k": INT,
            "stop_token_ids": list, "ignore_eos": BOOL}


def _check(fields: dict[str, Any], spec: Any, name: str) -> str | None:
    value = fields[name]
    if callable(spec) and not isinstance(spec, (tuple, type)):
        return None if spec(value) else f"bad value for {name}: {value!r}"
    types = spec if isinstance(spec, tuple) else (spec,)
    if isinstance(value, bool) and bool not in types:
        return f"{name} must be {types}, got bool"
    return None if isinstance(value, types) else f"{name} must be {types}, got {value!r}"


def validate(path: str, body: Any) -> str | None:
    """The first schema violation in ``body`` for ``path``, or None."""
    if path not in SCHEMAS:
        return f"unknown path {path}"
    if not isinstance(body, dict):
        return "body must be a JSON object"
    required, optional = SCHEMAS[path]
    for name in required:
        if name not in body:
            return f"missing required field {name}"
    for name in body:
        spec = required.get(name, optional.get(name))
        if spec is None:
            return f"unknown field {name}"
        error = _check(body, spec, name)
        if error:
            return error
    for name in body.get("sampling_params", {}) if path == "/generate" else ():
        if name not in SAMPLING:
            return f"unknown sampling param {name}"
        error = _check(body["sampling_params"], SAMPLING[name], name)
        if error:
            return error
    return None


class FakeSglang:
    """State and answers of the fake server; ``hold`` makes ``/generate`` wait for
    ``release`` (and sets ``arrived``), so tests can interleave calls deterministically."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.weight_version = "default"
        self.hold = False
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.group: Any = None  # join_groups: a real gloo group, as our learner builds it
        self.join_groups = False
        self.received: dict[str, torch.Tensor] = {}

    def answer(self, path: str, body: dict[str, Any]) -> Any:
        self.calls.append((path, body))
        if path == "/generate":
            return self._generate(body)
        if path in ("/pause_generation", "/continue_generation"):
            return {"message": "ok"}
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return {"success": True, "message": "ok", "new_version": self.weight_version}
        if path == "/init_weights_update_group" and self.join_groups:
            self._join(body)
        if path == "/update_weights_from_distributed" and self.join_groups:
            self._receive(body)
        if path == "/update_weights_from_distributed" and body.get("weight_version"):
            self.weight_version = body["weight_version"]
        return {"success": True, "message": "Succeeded to update parameter online."}

    def _join(self, body: dict[str, Any]) -> None:
        """Join the learner's group the way OUR receiver does (``PrefixStore("epoch<N>")``);
        real SGLang prefixes differently, see SglangWeightPeer's docstring."""
        store = dial_store(f"{body['master_address']}:{body['master_port']}", 10.0)
        epoch = int(body["group_name"].removeprefix("epoch"))
        self.group = new_group(body["backend"], store, epoch, body["rank_offset"],
                               body["world_size"], 10.0, "127.0.0.1")

    def _receive(self, body: dict[str, Any]) -> None:
        """``load_format = "flattened_bucket"``: one uint8 broadcast of the tensors' bytes
        back to back (SGLang's FlattenedTensorBucket), then split by dtype and shape."""
        assert body["load_format"] == "flattened_bucket"
        dtypes = [getattr(torch, d) for d in body["dtypes"]]
        sizes = [math.prod(s) * torch.empty(0, dtype=d).element_size()
                 for s, d in zip(body["shapes"], dtypes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        broadcast(self.group, flat)
        for name, dtype, shape, part in zip(body["names"], dtypes, body["shapes"],
                                            flat.split(sizes)):
            self.received[name] = part.view(dtype).view(shape)

    def _generate(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        if self.hold:
            self.arrived.set()
            self.release.wait(timeout=30)
        n_new = body["sampling_params"]["max_new_tokens"]
        out = []
        for i, row in enumerate(body["input_ids"]):
            tokens = [(sum(row) + i + k) % 50 for k in range(n_new)]
            out.append({"text": "", "output_ids": tokens, "meta_info": {
                "id": f"req-{i}", "finish_reason": {"type": "length", "length": n_new},
                "prompt_tokens": len(row), "completion_tokens": n_new,
                "weight_version": self.weight_version,
                "output_token_logprobs": [[-0.1 * (k + 1), t, None]
                                          for k, t in enumerate(tokens)]}})
        return out


def _handler(fake: FakeSglang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                return self._send(400, {"error": "invalid JSON"})
            error = validate(self.path, body)
            if error:
                return self._send(400, {"error": error})
            self._send(200, fake.answer(self.path, body))

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            return None

    return Handler


@pytest.fixture
def server() -> Iterator[tuple[str, FakeSglang]]:
    fake = FakeSglang()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", fake
    fake.release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join()


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


def test_greedy_sends_temperature_zero(server) -> None:
    url, fake = server
    SglangEngine(url).generate([[1]], n=1, temperature=1.0, max_new_tokens=1, greedy=True)
    assert fake.calls[0][1]["sampling_params"]["temperature"] == 0.0


def test_pause_update_continue_order_and_version(server) -> None:
    url, fake = server
    engine = SglangEngine(url)
    engine.init_weights_update_group("127.0.0.1", 29500, 1, 2, "epoch1", "gloo")
    with engine.paused():
        engine.update_weights_from_distributed(["a", "b"], ["float32", "bfloat16"],
                                               [[2, 2], [4]], "epoch1", flush_cache=True,
                                               weight_version="7", load_format="flattened_bucket")
    engine.set_version(7)
    engine.update_weight_version(7)
    assert [p for p, _ in fake.calls] == [
        "/init_weights_update_group", "/pause_generation", "/update_weights_from_distributed",
        "/continue_generation", "/update_weight_version"]
    assert fake.calls[1][1] == {"mode": "in_place"}
    assert fake.calls[4][1] == {"new_version": "7", "abort_all_requests": False}
    assert engine.version == 7 and fake.weight_version == "7"


def test_resume_even_when_update_fails(server) -> None:
    url, fake = server
    engine = SglangEngine(url)
    with pytest.raises(SglangError, match="HTTP 400.*shapes"), engine.paused():
        engine.update_weights_from_distributed(["a"], ["float32"], [["2"]], "g",
                                               flush_cache=False)
    assert [p for p, _ in fake.calls] == ["/pause_generation", "/continue_generation"]


def test_update_during_generate_marks_older_version(server) -> None:
    """A request that overlaps an update gets the version it started with (the older)."""
    url, fake = server
    engine = SglangEngine(url, version=1)
    fake.hold = True
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(
        engine.generate([[2]], n=1, temperature=1.0, max_new_tokens=2)))
    worker.start()
    assert fake.arrived.wait(timeout=10)
    with engine.paused():
        engine.update_weights_from_distributed(["a"], ["float32"], [[1]], "g", True, "2")
    engine.set_version(2)
    fake.release.set()
    worker.join(timeout=10)
    assert result[0][0][0].versions == [1, 1]
    assert engine.generate([[2]], 1, 1.0, 2)[0][0].versions == [2, 2]


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


def test_weight_peer_follows_the_real_broadcaster(server) -> None:
    """The peer's handshake, group join and per-bucket requests against the real
    WeightBroadcaster and broker; the fixture server receives the buckets over gloo."""
    url, fake = server
    fake.join_groups = True
    address, stop_broker = start_broker_thread(BufferConfig(port=0), groups_per_step=1)
    learner, own = ZmqBufferClient(address, 10.0), ZmqBufferClient(address, 10.0)
    engine = SglangEngine(url, update_timeout_s=20.0)
    peer = SglangWeightPeer(own, "sglang-0", engine)
    broadcaster = WeightBroadcaster(learner, WeightsConfig(bucket_mb=0.0001, timeout_s=10))
    try:
        learner.heartbeat("sglang-0", "rollout", {})
        peer.start()
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
                         "/update_weights_from_distributed", "/update_weights_from_distributed",
                         "/continue_generation"]
        updates = [b for p, b in fake.calls if p == "/update_weights_from_distributed"]
        assert [u["flush_cache"] for u in updates] == [False, True]
        assert updates[-1]["weight_version"] == "5" and updates[0]["group_name"] == "epoch1"
        assert len(peer.pause_s) == 1
    finally:
        peer.stop()
        broadcaster.close()
        learner.close()
        own.close()
        stop_broker()
