"""Replay buffers: the :class:`~buffers.protocol.BufferClient` protocol and its backends."""

from buffers.protocol import Batch, Buffer, BufferClient, ControlPlane, Grant, PutResult

__all__ = ["Batch", "Buffer", "BufferClient", "ControlPlane", "Grant", "PutResult",
           "connect_buffer", "make_buffer_client"]


def connect_buffer(cfg, address: str | None = None) -> BufferClient:
    """A client for the run described by the root config ``cfg`` (what every role opens)."""
    return make_buffer_client(cfg.buffer, address, run_id=cfg.run.name,
                              groups_per_step=cfg.learner.groups_per_step)


def make_buffer_client(config, address: str | None = None, *, run_id: str = "",
                       groups_per_step: int | None = None) -> BufferClient:
    """The one factory: a client for ``config.type`` (a :class:`asyncrl.config.BufferConfig`).

    ``address`` (``tcp://host:port``) overrides the one derived from the config, for roles
    pointed at a ZMQ broker started elsewhere. Redis has no broker process, so every client
    applies the gate itself and needs what the ZMQ broker is started with: ``run_id`` (the
    run name; keys live under ``buffer.namespace`` or ``asyncrl:<run_id>``) and
    ``groups_per_step`` (``learner.groups_per_step``). Both are ignored for ZMQ.
    """
    if config.type == "zmq":
        from buffers.zmq_client import ZmqBufferClient

        return ZmqBufferClient.from_config(config, address)
    if config.type == "redis":
        from buffers.redis_buffer import RedisBufferClient

        if groups_per_step is None:
            raise ValueError("buffer.type = 'redis' needs groups_per_step "
                             "(learner.groups_per_step): every client applies the gate")
        return RedisBufferClient(config, run_id=run_id, groups_per_step=groups_per_step)
    raise ValueError(f"buffer.type: unknown backend {config.type!r}")
