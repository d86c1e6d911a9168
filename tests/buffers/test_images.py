"""A group's prompt images (``asyncrl.wire.images``) through both buffers: the same bytes come
out, also after the server was killed and restarted; a malformed image frame, and a group
whose images make it too large, are counted rejections, never a crash."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from asyncrl.wire import TrajectoryGroup, encode_group
from asyncrl.wire.images import IMAGES, group_images, image_extras
from tests.buffers import make_group

pytestmark = pytest.mark.timeout(60)


def png(seed: int, size: int = 28) -> bytes:
    from asyncrl.vlm import encode_png

    rng = np.random.default_rng(seed)
    return encode_png(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def image_group(name: str, images: list[bytes]) -> TrajectoryGroup:
    group = make_group(name)
    group.extras.update(image_extras(images))
    return group


def test_images_round_trip_and_bad_ones_are_counted_rejections(backend):
    """The same bytes come out after a kill and restart (the spill file, the AOF); a frame
    with bytes missing and a group whose image puts it over the limit are refused."""
    d = backend.start(groups_per_step=2, reclaim_idle_s=0.5, max_message_bytes=16 << 10)
    c = d.client()
    c.acquire("w", 4, 0)
    sent = {"one": [png(0)], "two": [png(1), png(2, size=56)]}
    assert all(c.put("w", image_group(name, images)).accepted for name, images in sent.items())
    frames = encode_group(image_group("bad", [png(0)]))
    assert [e["name"] for e in orjson.loads(frames[0])["extras"]] == [IMAGES, "image_sizes"]
    short = c.put_frames("w", [*frames[:-2], frames[-2][:-1], frames[-1]])  # bytes missing
    big = c.put("w", image_group("big", [png(3, size=128)]))                # ~49 kB of noise
    assert (short.reason, big.reason) == ("length", "oversized")
    assert c.status()["rejected"] == {"length": 1, "oversized": 1}
    d.restart(kill=True)
    batch = d.client().get_batch("learner", 2, 0, timeout_s=10.0)
    assert batch is not None
    assert {g.group_id: group_images(g) for g in batch.groups} == sent
