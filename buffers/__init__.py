"""Replay buffers: the :class:`~buffers.protocol.BufferClient` protocol and its backends."""

from buffers.protocol import Batch, Buffer, BufferClient, ControlPlane, Grant, PutResult

__all__ = ["Batch", "Buffer", "BufferClient", "ControlPlane", "Grant", "PutResult",
           "make_buffer_client"]


def make_buffer_client(config, address: str | None = None) -> BufferClient:
    """The one factory: a client for ``config.type`` (a :class:`asyncrl.config.BufferConfig`).

    ``address`` (``tcp://host:port``) overrides the one derived from the config, for roles
    pointed at a broker started elsewhere.
    """
    if config.type == "zmq":
        from buffers.zmq_client import ZmqBufferClient

        return ZmqBufferClient(address or f"tcp://{config.host}:{config.port}",
                               timeout_s=config.request_timeout_s)
    raise ValueError(f"buffer.type: unknown backend {config.type!r}")
