"""buffers.zmq_frames: pyzmq's multipart send and receive without its convenience layer, over
real sockets (a ROUTER and a DEALER on 127.0.0.1, as the broker and its clients)."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from buffers.zmq_frames import recv_frames, send_frames


@pytest.fixture()
def pair():
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"client")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    for socket in (router, dealer):
        socket.setsockopt(zmq.RCVTIMEO, 5000)
    yield router, dealer
    for socket in (router, dealer):
        socket.close(linger=0)
    context.term()


def test_a_message_of_every_kind_of_frame_arrives_whole_and_in_order(pair):
    router, dealer = pair
    big = np.arange(100_000, dtype=np.int32)  # past copy_threshold: sent zero-copy
    frames = [b"id", bytearray(b"mutable"), memoryview(b"view"), zmq.Frame(b"frame"),
              big, b""]
    send_frames(dealer, frames)
    received = recv_frames(router)
    assert [f.bytes for f in received] == [b"client", b"id", b"mutable", b"view", b"frame",
                                           big.tobytes(), b""]
    assert all(isinstance(f, zmq.Frame) for f in received)
    assert [f.more for f in received] == [True] * 6 + [False]

    # received frames go on as they are (the broker forwards groups so), with flags
    send_frames(router, received, zmq.NOBLOCK)
    echoed = recv_frames(dealer)
    assert [f.bytes for f in echoed] == [b"id", b"mutable", b"view", b"frame", big.tobytes(),
                                         b""]


def test_one_frame_messages_and_consecutive_messages_stay_apart(pair):
    router, dealer = pair
    send_frames(dealer, [b"one"])
    send_frames(dealer, [b"two", b"parts"])
    assert [f.bytes for f in recv_frames(router)] == [b"client", b"one"]
    assert [f.bytes for f in recv_frames(router)] == [b"client", b"two", b"parts"]


def test_nothing_waiting_with_noblock_raises_again(pair):
    router, _ = pair
    with pytest.raises(zmq.Again):
        recv_frames(router, zmq.NOBLOCK)


def test_a_frame_that_is_no_buffer_is_refused_before_anything_is_sent(pair):
    """Refused half-way, a message would be left open and swallow the next one."""
    router, dealer = pair
    with pytest.raises(TypeError):
        send_frames(dealer, [b"first", "a str is no buffer"])
    with pytest.raises(TypeError):
        send_frames(dealer, [b"first", 42])
    send_frames(dealer, [b"next"])
    assert [f.bytes for f in recv_frames(router)] == [b"client", b"next"]
    with pytest.raises(zmq.Again):
        recv_frames(router, zmq.NOBLOCK)
