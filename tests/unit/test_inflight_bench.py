"""The buffer benchmark's TakeAhead (bench/inflight.py): its bookkeeping, with a scripted
client (against the real broker: tests/buffers/test_zmq_take_ahead.py)."""

from __future__ import annotations

from typing import Any

import pytest

from buffers.protocol import Batch
from bench.inflight import SendsAhead, TakeAhead


def batch(name: str) -> Batch:
    return Batch(groups=[], receipts=[name])


class Scripted:
    """Answers each request from ``answers[version]`` (a list, one per request sent for it);
    records what was sent and acked."""

    def __init__(self, answers: dict[int, list[Batch | None]]) -> None:
        self.answers = answers
        self.sent: list[tuple[int, list[str]]] = []  # (version, receipts acked with it)
        self.acked: list[list[str]] = []
        self.received: list[int] = []
        self.forgotten: list[int] = []

    def send_get_batch(self, consumer: str, count: int, learner_version: int,
                       timeout_s: float, ack: Batch | None = None) -> Any:
        self.sent.append((learner_version, ack.receipts if ack else []))
        return learner_version

    def receive_batch(self, pending: Any) -> Batch | None:
        self.received.append(pending)
        return self.answers[pending].pop(0)

    def ack(self, consumer: str, b: Batch, consumed: int | None = None) -> None:
        self.acked.append(b.receipts)

    def forget_batch(self, pending: Any) -> None:
        self.forgotten.append(pending)


def test_depth_requests_in_version_order_and_the_ack_rides_on_the_first_sent():
    client = Scripted({v: [batch(f"b{v}")] for v in range(6)})
    assert isinstance(client, SendsAhead)
    ahead = TakeAhead(client, "learner", 8, depth=3, timeout_s=1.0)
    first = ahead.take(0)
    assert first.receipts == ["b0"] and client.sent == [(0, []), (1, []), (2, [])]
    second = ahead.take(1, ack=first)
    assert second.receipts == ["b1"] and client.sent[3:] == [(3, ["b0"])]
    assert ahead.in_flight == 2 and client.acked == []


def test_an_empty_reply_drains_the_rest_and_keeps_their_batches_for_their_versions():
    client = Scripted({0: [None, batch("b0")], 1: [batch("b1")], 2: [None, batch("b2")],
                       3: [batch("b3")]})
    ahead = TakeAhead(client, "learner", 8, depth=3, timeout_s=1.0)
    assert ahead.take(0) is None
    assert client.received == [0, 1, 2] and ahead.in_flight == 0  # drained
    assert ahead.take(0).receipts == ["b0"]  # sent again: 0 then 2 (1 is kept)
    assert [v for v, _ in client.sent[3:]] == [0, 2]
    assert ahead.take(1).receipts == ["b1"]  # kept from the drain
    assert [v for v, _ in client.sent[5:]] == [3]
    got = ahead.take(2, ack=batch("b1"))
    assert got.receipts == ["b2"] and client.sent[6] == (4, ["b1"])


def test_an_ack_with_nothing_to_send_goes_alone():
    client = Scripted({0: [None], 1: [batch("b1")], 2: [batch("b2")]})
    ahead = TakeAhead(client, "learner", 8, depth=2, timeout_s=1.0)
    assert ahead.take(0) is None  # drained: b1 kept
    client.answers[0] = [batch("b0")]
    assert ahead.take(0).receipts == ["b0"]
    assert ahead.take(1, ack=batch("b0")).receipts == ["b1"]  # sends 2, with the ack
    assert client.sent[-1] == (2, ["b0"]) and client.acked == []
    ahead2 = TakeAhead(Scripted({0: [None], 1: [batch("x")]}), "l", 8, depth=2, timeout_s=1.0)
    assert ahead2.take(0) is None
    ahead2._client.answers[0] = [batch("y")]  # noqa: SLF001 - scripting the next answer
    ahead2.take(0)  # sends 0 only (1 is kept)
    assert ahead2.take(1, ack=batch("y")).receipts == ["x"]  # depth 2: sends 2 with the ack


def test_versions_out_of_order_are_refused():
    client = Scripted({v: [batch(f"b{v}")] for v in range(4)})
    ahead = TakeAhead(client, "learner", 8, depth=2, timeout_s=1.0)
    ahead.take(0)
    with pytest.raises(ValueError, match="in order"):
        ahead.take(3)


def test_an_error_gives_up_the_requests_in_flight():
    class Failing(Scripted):
        def receive_batch(self, pending: Any) -> Batch | None:
            raise TimeoutError("no answer")

    client = Failing({})
    ahead = TakeAhead(client, "learner", 8, depth=3, timeout_s=1.0)
    with pytest.raises(TimeoutError):
        ahead.take(0)
    assert ahead.in_flight == 0 and client.forgotten == [1, 2]  # never re-sent by the client


def test_a_client_that_cannot_send_ahead_takes_one_at_a_time():
    class Serial:
        def __init__(self) -> None:
            self.calls: list[tuple[int, list[str]]] = []

        def get_batch(self, consumer: str, count: int, learner_version: int,
                      timeout_s: float, ack: Batch | None = None) -> Batch | None:
            self.calls.append((learner_version, ack.receipts if ack else []))
            return batch(f"b{learner_version}")

    client = Serial()
    ahead = TakeAhead(client, "learner", 8, depth=4, timeout_s=1.0)  # type: ignore[arg-type]
    assert ahead.depth == 1
    first = ahead.take(0)
    ahead.take(1, ack=first)
    assert client.calls == [(0, []), (1, ["b0"])]
