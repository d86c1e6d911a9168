"""A group's prompt images on the wire: two extras of :mod:`asyncrl.wire.group`.

=============  =====  ==========  ==================================================
``images``     u1     [bytes]     every image's encoded bytes (PNG or JPEG), end to end
``image_sizes``  i4   [images]    each image's byte count, in the prompt's order
=============  =====  ==========  ==================================================

Every sample of a group shares its prompt, so the images travel once a group, not once a
sample. Encoded bytes, not pixels: a 28×28 PNG is ~100 bytes where its float32 patches are
4.7 kB, and the learner recomputes the pixels with the same image processor as the engine
(:mod:`asyncrl.vlm`).

The buffers check extras generically (declared dtype and shape against the frame's bytes) and
carry them unchanged. What the two arrays must mean together is checked by their consumer,
:func:`group_images`, with the same :class:`~asyncrl.wire.group.WireError` a buffer raises:
a learner drops such a group and counts it by reason (``images``; ``image_decode`` for bytes
that pass these checks and still do not decode), it never crashes on one.

numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asyncrl.wire.group import TrajectoryGroup, WireError

IMAGES = "images"
IMAGE_SIZES = "image_sizes"
MAX_IMAGES = 64
"""Images of one prompt at most."""
MAX_IMAGE_BYTES = 16 << 20
"""Encoded bytes of one image at most (``buffer.max_message_bytes`` bounds the whole group)."""
SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")
"""PNG's and JPEG's first bytes: anything else is refused before a decoder sees it."""


def image_extras(images: Sequence[bytes]) -> dict[str, np.ndarray]:
    """The two extras carrying ``images`` (none for a prompt without images)."""
    if not images:
        return {}
    sizes = np.array([len(image) for image in images], dtype="<i4")
    joined = np.frombuffer(b"".join(bytes(image) for image in images), dtype=np.uint8)
    return {IMAGES: joined, IMAGE_SIZES: sizes}


def group_images(group: TrajectoryGroup) -> list[bytes]:
    """The group's prompt images ([] without), checked; :class:`WireError` ``images`` when the
    extras disagree with each other or break a limit."""
    joined, sizes = group.extras.get(IMAGES), group.extras.get(IMAGE_SIZES)
    if joined is None and sizes is None:
        return []
    if joined is None or sizes is None:
        raise _error(f"{IMAGES!r} and {IMAGE_SIZES!r} travel together; got only "
                     f"{IMAGES if sizes is None else IMAGE_SIZES!r}")
    if joined.dtype != np.uint8 or joined.ndim != 1:
        raise _error(f"{IMAGES!r} must be 1-D u1, got {joined.dtype} {list(joined.shape)}")
    if sizes.dtype.kind != "i" or sizes.ndim != 1:
        raise _error(f"{IMAGE_SIZES!r} must be 1-D integers, got {sizes.dtype} "
                     f"{list(sizes.shape)}")
    if not 0 < len(sizes) <= MAX_IMAGES:
        raise _error(f"{len(sizes)} images, between 1 and {MAX_IMAGES} allowed")
    if int(sizes.min()) <= 0 or int(sizes.max()) > MAX_IMAGE_BYTES:
        raise _error(f"image sizes must be 1..{MAX_IMAGE_BYTES} bytes, got "
                     f"{int(sizes.min())}..{int(sizes.max())}")
    if int(sizes.sum()) != len(joined):
        raise _error(f"image sizes add up to {int(sizes.sum())} bytes, {IMAGES!r} holds "
                     f"{len(joined)}")
    ends = np.cumsum(sizes)
    images = [joined[end - size:end].tobytes() for end, size in zip(ends, sizes)]
    for index, image in enumerate(images):
        if not image.startswith(SIGNATURES):
            raise _error(f"image {index} is neither PNG nor JPEG")
    return images


def _error(detail: str) -> WireError:
    return WireError("images", detail)


__all__ = ["IMAGES", "IMAGE_SIZES", "MAX_IMAGES", "MAX_IMAGE_BYTES", "group_images",
           "image_extras"]
