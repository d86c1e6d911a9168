"""The rules of a group's image extras (``asyncrl.wire.images``): what the buffers cannot check
generically, checked by their consumer with a countable ``images`` reason."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.wire import WireError, decode_group, encode_group
from asyncrl.wire.images import IMAGE_SIZES, IMAGES, MAX_IMAGES, group_images, image_extras
from tests.buffers import make_group

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
JPEG = b"\xff\xd8\xff" + bytes(20)


def with_extras(**extras: np.ndarray):
    group = make_group("g")
    group.extras.update(extras)
    return group


def test_images_survive_encoding_and_a_group_without_has_none() -> None:
    group = with_extras(**image_extras([PNG, JPEG]))
    assert group_images(decode_group(encode_group(group))) == [PNG, JPEG]
    assert group_images(make_group("plain")) == [] and image_extras([]) == {}


@pytest.mark.parametrize("extras, detail", [
    ({IMAGES: np.frombuffer(PNG, np.uint8)}, "travel together"),
    ({**image_extras([PNG]), IMAGE_SIZES: np.array([len(PNG) + 1], "<i4")}, "add up to"),
    ({**image_extras([PNG]), IMAGE_SIZES: np.array([len(PNG), 0], "<i4")}, "sizes must be"),
    ({**image_extras([b"GIF89a" + bytes(9)])}, "image 0 is neither PNG nor JPEG"),
    ({**image_extras([PNG] * (MAX_IMAGES + 1))}, f"between 1 and {MAX_IMAGES}"),
    ({**image_extras([PNG]), IMAGE_SIZES: np.array([[len(PNG)]], "<i4")}, "1-D integers"),
])
def test_broken_image_extras_are_a_wire_error_named_images(extras, detail) -> None:
    with pytest.raises(WireError, match=detail) as error:
        group_images(decode_group(encode_group(with_extras(**extras))))
    assert error.value.reason == "images"
