"""The wire format: :class:`TrajectoryGroup` as an orjson header plus raw array frames."""

from asyncrl.wire.group import (
    SCHEMA_VERSION,
    EXTRA_DTYPES,
    ExtraSpec,
    GroupHeader,
    Rejections,
    TrajectoryGroup,
    WireError,
    decode_group,
    decode_header,
    encode_group,
    encode_group_views,
    oversized,
    value_error,
)

__all__ = [
    "SCHEMA_VERSION",
    "EXTRA_DTYPES",
    "ExtraSpec",
    "GroupHeader",
    "Rejections",
    "TrajectoryGroup",
    "WireError",
    "decode_group",
    "decode_header",
    "encode_group",
    "encode_group_views",
    "oversized",
    "value_error",
]
