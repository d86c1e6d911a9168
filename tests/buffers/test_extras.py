"""Optional wire frames (``extras``, e.g. an MoE engine's ``routing``) through both buffers.

Each backend moves a group as one packed value, whatever its frame count: a group with extras
comes out with the same arrays (bytes, dtype and shape), also after the server was killed and
restarted (the ZMQ broker's spill file, Redis's AOF), and malformed declarations are counted
rejections with the wire's reason.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from asyncrl.wire import TrajectoryGroup, encode_group
from tests.buffers import make_group

pytestmark = pytest.mark.timeout(60)


def routed_group(name: str, seed: int) -> TrajectoryGroup:
    """``make_group`` with a ``[tokens, layers, top_k]`` uint8 routing extra and an int16 one."""
    group = make_group(name)
    rng = np.random.default_rng(seed)
    group.extras = {"routing": rng.integers(0, 8, (group.num_tokens, 3, 2), dtype=np.uint8),
                    "other": rng.integers(-9, 9, (5,), dtype=np.int16)}
    return group


def test_extras_round_trip_through_a_kill_and_restart(backend):
    d = backend.start(groups_per_step=4, reclaim_idle_s=0.5)
    c = d.client()
    sent = [routed_group(f"g{i}", seed=i) for i in range(3)]
    assert all(c.put("w", g).accepted for g in sent)
    d.restart(kill=True)  # what comes back is read from the spill file / the AOF
    batch = d.client().get_batch("learner", 3, 0, timeout_s=10.0)
    assert batch is not None and [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
    for got, want in zip(batch.groups, sent):
        assert list(got.extras) == ["routing", "other"]
        for name, array in want.extras.items():
            assert got.extras[name].dtype == array.dtype.newbyteorder("<")
            np.testing.assert_array_equal(got.extras[name], array)
        np.testing.assert_array_equal(got.tokens, want.tokens)


def test_malformed_extras_are_counted_rejections(backend):
    c = backend.start(groups_per_step=8).client()
    c.acquire("w", 3, 0)
    frames = encode_group(routed_group("bad", seed=0))
    header = orjson.loads(frames[0])
    wrong_dtype = {**header, "extras": [{**header["extras"][0], "dtype": "f8"},
                                        header["extras"][1]]}
    results = [c.put_frames("w", frames[:-1]),  # a declared extra's frame is missing
               c.put_frames("w", [orjson.dumps(wrong_dtype), *frames[1:]]),
               c.put_frames("w", [*frames[:-1], frames[-1][:-2]])]
    assert [r.reason for r in results] == ["frames", "extras", "length"]
    assert c.status()["rejected"] == {"frames": 1, "extras": 1, "length": 1}
