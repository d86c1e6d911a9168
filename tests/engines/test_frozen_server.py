"""A frozen inference server (its process alive, its socket accepting, nothing ever answered:
SIGSTOPped, or its engine stuck) is a clear error after the request timeout, naming the URL
and ``rollout.request_timeout_s``, not a rollout worker that hangs. The server is a real
listening socket in a thread that accepts connections and never writes a byte."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from rollouters.engines.sglang_engine import SglangEngine, SglangTimeout
from rollouters.engines.vllm_server import ServerError, VLLMServerEngine

TIMEOUT_S = 0.5
KEY = r"\(rollout\.request_timeout_s\)"


@pytest.fixture
def frozen_url() -> Iterator[str]:
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []  # kept open: the client sees no reset, only silence

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # the listener closed: the test is over
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    host, port = listener.getsockname()[:2]
    yield f"http://{host}:{port}"
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    thread.join(timeout=5)
    for conn in held:
        conn.close()


def test_vllm_server_engine_reports_a_frozen_server(frozen_url: str) -> None:
    started = time.monotonic()
    with pytest.raises(ServerError, match=rf"GET {frozen_url}/weight_info: no answer within "
                                          rf"0\.5s {KEY}"):
        VLLMServerEngine(frozen_url, eos_ids=(0,), timeout_s=TIMEOUT_S)  # attaches: one GET
    assert time.monotonic() - started < 10 * TIMEOUT_S


def test_sglang_engine_reports_a_frozen_server(frozen_url: str) -> None:
    engine = SglangEngine(frozen_url, timeout_s=TIMEOUT_S, generate_timeout_s=TIMEOUT_S)
    started = time.monotonic()
    with pytest.raises(SglangTimeout, match=rf"POST {frozen_url}/generate: no answer within "
                                            rf"0\.5s {KEY}"):
        engine.generate([[1, 2]], n=1, temperature=1.0, max_new_tokens=2)
    with pytest.raises(SglangTimeout, match=rf"/pause_generation: no answer within 0\.5s {KEY}"):
        engine.pause()
    assert time.monotonic() - started < 20 * TIMEOUT_S
