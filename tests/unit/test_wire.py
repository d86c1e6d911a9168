"""Wire format: round trip, and every malformed message is a counted rejection, not a crash."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from asyncrl.wire import Rejections, TrajectoryGroup, WireError, decode_group, encode_group


def make_group(rewards=(1.0, 0.25), versions=(3, 4)) -> TrajectoryGroup:
    samples = []
    for reward, version in zip(rewards, versions):
        samples.append({"tokens": [1, 5, 6, 2, 5, 6, 3], "reward": reward,
                        "logprobs": [0, 0, 0, 0, -0.5, -0.25, -1.0],
                        "loss_mask": [0, 0, 0, 0, 1, 1, 1],
                        "versions": [-1, -1, -1, -1, version, version, version + 1],
                        "finish_reason": "stop"})
    return TrajectoryGroup.from_samples("g1", "p1", samples, run_id="r", metadata={"k": 1})


def test_round_trip_is_exact() -> None:
    group = make_group()
    back = decode_group(encode_group(group))
    assert (back.group_id, back.prompt_id, back.run_id) == ("g1", "p1", "r")
    assert back.rewards == group.rewards and back.lengths == [7, 7]
    assert back.metadata == {"k": 1} and back.finish_reasons == ["stop", "stop"]
    for name in ("tokens", "logprobs", "loss_mask", "versions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(group, name))
        assert getattr(back, name).dtype == getattr(group, name).dtype


def test_extras_round_trip_with_dtype_and_shape() -> None:
    """Optional frames (an MoE engine's routing) come back exactly; a group without them has
    no ``extras`` key, so its bytes are those of a group from before extras existed."""
    group = make_group()
    assert b"extras" not in encode_group(group)[0] and len(encode_group(group)) == 5
    routing = np.arange(14 * 2 * 2, dtype=np.uint8).reshape(14, 2, 2)
    group.extras = {"routing": routing, "scale": np.array([0.5, -1.0], dtype=np.float32)}
    frames = encode_group(group)
    assert len(frames) == 7 and orjson.loads(frames[0])["extras"][0] == {
        "name": "routing", "dtype": "u1", "shape": [14, 2, 2]}
    back = decode_group(frames)
    assert list(back.extras) == ["routing", "scale"]
    np.testing.assert_array_equal(back.extras["routing"], routing)
    assert back.extras["scale"].dtype == np.dtype("<f4")
    with pytest.raises(ValueError, match="dtype"):
        group.extras = {"flags": np.zeros(3, dtype=bool)}
        encode_group(group)


def test_staleness_uses_oldest_generated_token() -> None:
    group = make_group(versions=(3, 4))
    assert group.min_version() == 3
    assert group.staleness(5) == 2
    assert [s.stop - s.start for s in group.sample_slices()] == [7, 7]


def test_frames_are_little_endian_raw_arrays() -> None:
    frames = encode_group(make_group())
    assert np.frombuffer(frames[1], dtype="<i4").tolist()[:3] == [1, 5, 6]
    assert all(b"pickle" not in f for f in frames)


def _header(frames: list[bytes], **changes) -> list[bytes]:
    header = orjson.loads(frames[0])
    header.update(changes)
    return [orjson.dumps(header), *frames[1:]]


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda f: f[:3], "frames"),
    (lambda f: [b"{not json", *f[1:]], "header"),
    (lambda f: _header(f, schema=99), "schema"),
    (lambda f: [f[0], f[1][:-2], *f[2:]], "length"),
    (lambda f: _header(f, lengths=[7, 8]), "length"),
    (lambda f: _header(f, rewards=[1.0]), "length"),
    (lambda f: [orjson.dumps({**orjson.loads(f[0]), "rewards": [1.0, "x"]}), *f[1:]], "header"),
    (lambda f: [f[0].replace(b'"rewards":[1.0', b'"rewards":[NaN'), *f[1:]], "header"),
    (lambda f: [f[0], f[1], np.full(14, np.nan, "<f4").tobytes(), *f[3:]], "logprob"),
    (lambda f: [*f[:4], np.full(14, -1, "<i4").tobytes()], "version"),
])
def test_rejections(mutate, reason: str) -> None:
    with pytest.raises(WireError) as info:
        decode_group(mutate(encode_group(make_group())))
    assert info.value.reason == reason


def test_nan_reward_rejected() -> None:
    with pytest.raises(WireError) as info:
        decode_group(encode_group(make_group(rewards=(float("nan"), 1.0))))
    assert info.value.reason == "reward"


def test_rejections_are_counted() -> None:
    counter = Rejections()
    for bad in ([b"x"], encode_group(make_group(rewards=(float("inf"), 0.0)))):
        try:
            decode_group(bad)
        except WireError as error:
            counter.add(error, "test")
    assert counter.counts == {"frames": 1, "reward": 1} and counter.total == 2


def test_structure_checked_without_value_scan() -> None:
    """``check_values=False`` (a consumer behind a validating broker) still refuses what it
    could not index safely, and lets the value scans go."""
    frames = encode_group(make_group())
    with pytest.raises(WireError) as info:
        decode_group([frames[0], frames[1][:-2], *frames[2:]], check_values=False)
    assert info.value.reason == "length"
    nan_logprobs = [frames[0], frames[1], np.full(14, np.nan, "<f4").tobytes(), *frames[3:]]
    with pytest.raises(WireError):
        decode_group(nan_logprobs)
    assert np.isnan(decode_group(nan_logprobs, check_values=False).logprobs).all()
