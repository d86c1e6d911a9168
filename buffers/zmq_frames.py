"""Multipart messages sent and received without pyzmq's convenience layer.

``Socket.send_multipart`` and ``recv_multipart`` are Python loops over the Cython socket that
build an ``IntFlag`` (``SNDMORE | flags``, through ``enum``) for every frame sent and call
``getsockopt(RCVMORE)`` for every frame received, although the Cython ``recv`` has already
read that flag into ``Frame.more``. A message of 12 frames (a ``put_many`` of 8 groups, or a
batch) cost 20 µs to receive and 19 µs to send on the 2-core VM; these loops, which call the
Cython methods with plain ints, 8 and 5 µs (``bench/RESULTS.md``).
The broker pays that on every request and every batch it serves, the clients on every reply,
and the broker's main thread is what bounds small groups: its CPU per 1k-token group fell
from ~46 to ~39 µs (``bench/RESULTS.md``).

The semantics are pyzmq's, ``copy=False``: ``zmq.Frame`` objects go out without a copy,
buffers below the socket's ``copy_threshold`` are copied, larger ones are sent zero-copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _CSocket

_MORE = int(zmq.SNDMORE)
_send = _CSocket.send
_recv = _CSocket.recv
_SENDABLE = (zmq.Frame, bytes, memoryview, bytearray)


def send_frames(socket: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """``socket.send_multipart(frames, flags, copy=False)``. Every frame is checked to be a
    buffer before the first is sent, as pyzmq does: a frame refused half-way would leave
    the socket in the middle of a message, and the next send would continue it."""
    flags = int(flags)  # an IntFlag would take enum's slow path at every `|`
    for frame in frames:
        if not isinstance(frame, _SENDABLE):
            memoryview(frame)  # raises TypeError for what cannot be sent
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(socket, frame, (flags | _MORE) if i < last else flags, copy=False)


def recv_frames(socket: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``socket.recv_multipart(flags, copy=False)``: every frame of the next message
    (``zmq.Again`` with ``zmq.NOBLOCK`` when none is waiting)."""
    flags = int(flags)
    frame = _recv(socket, flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = _recv(socket, flags, copy=False)
        frames.append(frame)
    return frames
