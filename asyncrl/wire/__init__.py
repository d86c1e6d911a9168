"""The wire format: :class:`TrajectoryGroup` as an orjson header plus raw array frames."""

from asyncrl.wire.group import (
    SCHEMA_VERSION,
    Rejections,
    TrajectoryGroup,
    WireError,
    decode_group,
    encode_group,
    encode_group_views,
)

__all__ = [
    "SCHEMA_VERSION",
    "Rejections",
    "TrajectoryGroup",
    "WireError",
    "decode_group",
    "encode_group",
    "encode_group_views",
]
