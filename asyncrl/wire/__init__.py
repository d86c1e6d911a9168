"""The wire format: :class:`TrajectoryGroup` as an orjson header plus raw array frames."""

from asyncrl.wire.group import (
    SCHEMA_VERSION,
    GroupHeader,
    Rejections,
    TrajectoryGroup,
    WireError,
    check_array_sizes,
    check_frame_count,
    decode_group,
    decode_header,
    encode_group,
    encode_group_views,
    value_error,
)

__all__ = [
    "SCHEMA_VERSION",
    "GroupHeader",
    "Rejections",
    "TrajectoryGroup",
    "WireError",
    "check_array_sizes",
    "check_frame_count",
    "decode_group",
    "decode_header",
    "encode_group",
    "encode_group_views",
    "value_error",
]
