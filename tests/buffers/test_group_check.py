"""The broker's group check (``buffers.group_check``): the compiled scan, the numpy fallback and
the learner's ``decode_group`` accept and reject the same groups, for the same reason and
message.

The compiled path (``buffers/_groupscan.c``) is what the broker runs; the fallback is what it
runs where the extension did not build. Each case is checked three ways and must agree on the
outcome: the rejection (reason and message) or the facts the broker keeps (run id, oldest
version, size), the latter against ``TrajectoryGroup.min_version`` of the decoded group. The
compiled path applies the header's rules itself (on the object orjson parsed), so the header
cases below include the odd values Python's ``float()``, ``int()`` and ``str()`` accept.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable

import numpy as np
import orjson
import pytest

from asyncrl.wire import TrajectoryGroup, WireError, decode_group, encode_group
import buffers
from buffers import group_check
from buffers.group_check import GroupFacts, check_packed
from buffers.packing import pack_group, unpack_group

Outcome = tuple[str, str] | GroupFacts


def make_frames(tokens: int = 12, samples: int = 3, seed: int = 0) -> list[bytes]:
    """A valid group: 4 prompt tokens (version -1, untrained), the rest generated."""
    rng = np.random.default_rng(seed)
    rows = [{"tokens": rng.integers(0, 100, tokens), "reward": float(rng.random()),
             "logprobs": np.r_[np.zeros(4), -rng.random(tokens - 4)],
             "loss_mask": np.r_[np.zeros(4), np.ones(tokens - 4)],
             "versions": np.r_[np.full(4, -1), rng.integers(3, 9, tokens - 4)],
             "finish_reason": "stop"} for _ in range(samples)]
    group = TrajectoryGroup.from_samples("g", "p", rows, run_id="run-a", metadata={"k": 1})
    return encode_group(group)


def outcome(check: Callable[[], GroupFacts]) -> Outcome:
    try:
        return check()
    except WireError as exc:
        return exc.reason, str(exc)


def reference(packed: bytes, max_bytes: int | None = None) -> Outcome:
    """What a learner's full decode says about the same bytes."""
    def decode() -> GroupFacts:
        if max_bytes is not None and len(packed) > max_bytes:
            raise WireError("oversized", f"{len(packed)} bytes > max_message_bytes {max_bytes}")
        group = decode_group(unpack_group(packed))
        return GroupFacts(group.run_id, group.min_version(), len(packed))
    return outcome(decode)


def assert_agree(packed: bytes, max_bytes: int | None = None) -> Outcome:
    expected = reference(packed, max_bytes)
    assert outcome(lambda: check_packed(packed, max_bytes, compiled=False)) == expected
    assert outcome(lambda: check_packed(packed, max_bytes, compiled=True)) == expected
    return expected


MISSING = object()  # a header change that deletes the key


def with_header(frames: list[bytes], **changes: object) -> list[bytes]:
    header = orjson.loads(frames[0])
    for key, value in changes.items():
        if value is MISSING:
            header.pop(key)
        else:
            header[key] = value
    return [json.dumps(header).encode(), *frames[1:]]  # json: ints past 64 bits too


def with_array(frames: list[bytes], index: int, dtype: str, edit: Callable[[np.ndarray], None]
               ) -> list[bytes]:
    array = np.frombuffer(frames[index], dtype=dtype).copy()
    edit(array)
    return [*frames[:index], array.tobytes(), *frames[index + 1:]]


def test_the_extension_is_built() -> None:
    """``make test`` installs the package with its C scan; without it the broker falls back
    to numpy (slower), and the benchmarks would measure that by mistake."""
    assert group_check.COMPILED, (
        "buffers._groupscan is not built: reinstall with a C compiler and Python headers "
        "(pip install -e .), see setup.py")


def test_valid_groups_agree_on_run_and_oldest_version() -> None:
    for seed in range(5):
        facts = assert_agree(pack_group(make_frames(tokens=5 + seed * 7, seed=seed)))
        assert isinstance(facts, GroupFacts) and facts.run_id == "run-a"
        assert 3 <= facts.min_version <= 8


def test_a_group_with_no_generated_token_has_no_version() -> None:
    frames = make_frames()
    frames = with_array(frames, 3, "u1", lambda a: a.fill(0))
    frames = with_array(frames, 4, "<i4", lambda a: a.fill(-1))
    packed = pack_group(frames)
    assert assert_agree(packed) == GroupFacts("run-a", -1, len(packed))


def test_value_rules_only_apply_to_trained_tokens() -> None:
    frames = make_frames()
    nan_on_prompt = with_array(frames, 2, "<f4", lambda a: a.__setitem__(0, np.nan))
    assert isinstance(assert_agree(pack_group(nan_on_prompt)), GroupFacts)
    for value in (np.nan, np.inf, -np.inf):
        bad = with_array(frames, 2, "<f4", lambda a, v=value: a.__setitem__(-1, v))
        assert assert_agree(pack_group(bad))[0] == "logprob"
    no_version = with_array(frames, 4, "<i4", lambda a: a.__setitem__(5, -3))
    assert assert_agree(pack_group(no_version))[0] == "version"
    both = with_array(no_version, 2, "<f4", lambda a: a.__setitem__(7, np.inf))
    assert assert_agree(pack_group(both))[0] == "logprob"  # decode_group's order


@pytest.mark.parametrize("changes, reason", [
    ({"schema": 99}, "schema"),
    ({"schema": "1"}, "schema"),
    ({"schema": None}, "schema"),
    ({"schema": MISSING}, "schema"),
    ({"schema": 1.0}, "ok"),  # == 1 in Python, so in both paths
    ({"schema": True}, "ok"),
    ({"rewards": MISSING}, "header"),
    ({"rewards": None}, "header"),
    ({"rewards": 3}, "header"),
    ({"rewards": [1.0, "x", 0.0]}, "header"),
    ({"rewards": [1.0, [2], 0.0]}, "header"),
    ({"rewards": ["1.5", True, 0]}, "ok"),  # float() takes them
    ({"rewards": [1.0, None, 0.0]}, "reward"),
    ({"rewards": [1.0, "nan", 0.0]}, "reward"),
    ({"rewards": [1.0, "inf", 0.0]}, "reward"),
    ({"rewards": {"a": 1, "b": 2, "c": 3}}, "header"),  # iterates the keys: float("a")
    ({"lengths": "twelve"}, "header"),
    ({"lengths": [12, 12]}, "length"),
    ({"lengths": [12, 0, 24]}, "length"),
    ({"lengths": [12, -5, 29]}, "length"),
    ({"lengths": ["12", 12.9, 12]}, "ok"),  # int() takes them
    ({"lengths": [12, 12, 10**30]}, "length"),  # past 64 bits: sizes cannot agree
    ({"lengths": [12, -(10**30), 10**30 + 24]}, "length"),
    ({"lengths": [2**62, 2**62, 2**62]}, "length"),
    ({"lengths": [12, [1], 12]}, "header"),
    ({"lengths": []}, "length"),
    ({"lengths": MISSING}, "header"),
    ({"finish_reasons": ["stop", "stop"]}, "length"),
    ({"finish_reasons": 5}, "header"),
    ({"finish_reasons": "abc"}, "ok"),  # three characters: three reasons
    ({"group_id": MISSING}, "header"),
    ({"prompt_id": MISSING}, "header"),
    ({"group_id": 7, "prompt_id": [1]}, "ok"),  # str() takes anything
    ({"rewards": [1.0, None, 0.0], "lengths": [12, 0, 24]}, "length"),  # decode's order
    ({"rewards": [1.0, None, 0.0], "lengths": [1]}, "length"),
    ({"metadata": [1, 2]}, "header"),
    ({"metadata": []}, "ok"),  # `or {}`: anything falsy is no metadata
    ({"metadata": 0}, "ok"),
    ({"metadata": "x"}, "header"),
    ({"run_id": 12}, "ok"),
    ({"lengths": [12, 12, 13]}, "length"),  # arrays hold 36 tokens, the header says 37
])
def test_header_rules_agree(changes: dict, reason: str) -> None:
    result = assert_agree(pack_group(with_header(make_frames(), **changes)))
    assert (result[0] if isinstance(result, tuple) else "ok") == reason


def test_header_values_that_are_not_objects_or_json_agree() -> None:
    frames = make_frames()
    for text in (b"{not json", b"[1, 2]", b"null", b"7", b'"s"', b"", b"\xff", b"{}",
                 b'{"schema": 1}'):
        assert assert_agree(pack_group([text, *frames[1:]]))[0] in {"header", "schema"}


def test_the_size_bound_is_checked_first_by_both_paths() -> None:
    packed = pack_group(make_frames())
    assert assert_agree(packed, max_bytes=len(packed)) == reference(packed)
    assert assert_agree(packed, max_bytes=len(packed) - 1)[0] == "oversized"
    assert assert_agree(b"\x05", max_bytes=0)[0] == "oversized"  # before the packing


def test_broken_headers_and_frame_counts_agree() -> None:
    frames = make_frames()
    assert assert_agree(pack_group([b"{not json", *frames[1:]]))[0] == "header"
    assert assert_agree(pack_group([b"[1, 2]", *frames[1:]]))[0] == "header"
    for count in (0, 1, 4, 6):
        assert assert_agree(pack_group((frames * 2)[:count]))[0] == "frames"
    short = with_array(frames, 3, "u1", lambda a: None)
    short[3] = short[3][:-1]
    assert assert_agree(pack_group(short))[0] == "length"


def test_broken_packing_agrees() -> None:
    packed = pack_group(make_frames())
    for broken in (b"", b"\x05", packed[:10], packed[:-1], packed + b"\0",
                   struct.pack("<H", 0x8000 | 5) + packed[2:7]):
        assert assert_agree(broken)[0] == "frames"


def test_the_unaligned_packing_of_old_spill_files_reads_the_same() -> None:
    frames = make_frames(tokens=13)
    head = struct.pack("<H5I", 5, *(len(f) for f in frames))
    unaligned = head + b"".join(frames)
    old, new = assert_agree(unaligned), assert_agree(pack_group(frames))
    assert isinstance(old, GroupFacts) and isinstance(new, GroupFacts)
    assert (old.run_id, old.min_version) == (new.run_id, new.min_version)


def test_random_corruptions_agree() -> None:
    """Bytes flipped anywhere (lengths, header, arrays): all three paths agree every time."""
    reasons = corruption_outcomes(pack_group(make_frames(tokens=9, samples=2)), seed=7)
    assert {"ok", "frames", "header"} <= reasons and reasons & {"logprob", "version"}


def corruption_outcomes(packed: bytes, seed: int, tries: int = 400) -> set[str]:
    """Flip 1-3 random bytes ``tries`` times; every path must agree each time. The reasons
    (or "ok") seen."""
    rng = np.random.default_rng(seed)
    reasons = set()
    for _ in range(tries):
        corrupt = bytearray(packed)
        for place in rng.integers(0, len(corrupt), rng.integers(1, 4)):
            corrupt[place] = int(rng.integers(0, 256))
        result = assert_agree(bytes(corrupt))
        reasons.add(result[0] if isinstance(result, tuple) else "ok")
    return reasons


def test_a_zmq_frame_is_checked_without_a_copy() -> None:
    """The broker passes the received ``zmq.Frame`` itself."""
    zmq = pytest.importorskip("zmq")
    packed = pack_group(make_frames())
    assert check_packed(zmq.Frame(packed)) == check_packed(packed)


@pytest.mark.parametrize("exported", ["scan", "check"])
def test_an_extension_built_from_an_older_source_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                                              exported: str) -> None:
    """An install not redone after a pull keeps the old ``_groupscan`` (no ``check``; or a
    ``check`` from before extras, without ``MAX_EXTRAS``): the broker must fall back to the
    numpy path and say why, not fail every put (or refuse every group with extras)."""
    import importlib.util
    import types

    old = types.ModuleType("buffers._groupscan")
    setattr(old, exported, lambda *args: None)  # what a previous source exported
    monkeypatch.setitem(sys.modules, "buffers._groupscan", old)
    monkeypatch.setattr(buffers, "_groupscan", old, raising=False)
    spec = importlib.util.spec_from_file_location("group_check_copy", group_check.__file__)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "group_check_copy", copy)  # dataclasses look it up
    spec.loader.exec_module(copy)
    assert copy.STALE and not copy.COMPILED
    assert "older source" in copy.describe()
    packed = pack_group(make_frames())
    assert copy.check_packed(packed).run_id == "run-a"


# --- optional frames (extras) -------------------------------------------------------------------

def make_extra_frames(tokens: int = 12, samples: int = 3) -> list[bytes]:
    """:func:`make_frames` with a uint8 ``routing`` extra ``[tokens, 2, 2]`` and an int16 one."""
    group = decode_group(make_frames(tokens, samples))
    rng = np.random.default_rng(1)
    group.extras = {"routing": rng.integers(0, 4, (group.num_tokens, 2, 2), dtype=np.uint8),
                    "pixels": np.arange(6, dtype=np.int16).reshape(2, 3)}
    return encode_group(group)


def with_extras(frames: list[bytes], extras: object) -> list[bytes]:
    return with_header(frames, extras=extras)


def test_a_group_with_extras_agrees_and_decodes_them() -> None:
    frames = make_extra_frames()
    facts = assert_agree(pack_group(frames))
    assert isinstance(facts, GroupFacts) and facts.run_id == "run-a"
    group = decode_group(unpack_group(pack_group(frames)))
    assert group.extras["routing"].shape == (36, 2, 2)
    np.testing.assert_array_equal(group.extras["pixels"], np.arange(6).reshape(2, 3))


ROUTING = {"name": "routing", "dtype": "u1", "shape": [36, 2, 2]}
PIXELS = {"name": "pixels", "dtype": "i2", "shape": [2, 3]}


@pytest.mark.parametrize("extras, reason", [
    ([ROUTING, PIXELS], "ok"),
    ([], "frames"),            # no extras declared: two frames too many
    (None, "frames"),          # `or []`, as metadata
    (0, "frames"),
    ({"a": 1}, "extras"),      # not a list
    ("routing", "extras"),
    ([ROUTING], "frames"),     # one frame too many
    ([ROUTING, PIXELS, PIXELS], "extras"),  # declared twice (before the count is checked)
    ([ROUTING, {**PIXELS, "name": "p2"}, {**PIXELS, "name": "p3"}], "frames"),
    ([ROUTING, [1]], "extras"),
    ([ROUTING, {**PIXELS, "name": ""}], "extras"),
    ([ROUTING, {**PIXELS, "name": 5}], "extras"),
    ([ROUTING, {"dtype": "i2", "shape": [2, 3]}], "extras"),
    ([ROUTING, {**PIXELS, "dtype": "f8"}], "extras"),
    ([ROUTING, {**PIXELS, "dtype": ["i2"]}], "extras"),
    ([ROUTING, {**PIXELS, "dtype": None}], "extras"),
    ([ROUTING, {**PIXELS, "shape": [2, -3]}], "extras"),
    ([ROUTING, {**PIXELS, "shape": [2, 3.0]}], "extras"),
    ([ROUTING, {**PIXELS, "shape": [2, True]}], "extras"),
    ([ROUTING, {**PIXELS, "shape": [1] * 9}], "extras"),
    ([ROUTING, {**PIXELS, "shape": "23"}], "extras"),
    ([ROUTING, {**PIXELS, "shape": [2, -(10**30)]}], "extras"),
    ([ROUTING, {**PIXELS, "shape": [3, 3]}], "length"),
    ([ROUTING, {**PIXELS, "shape": [6]}], "ok"),     # the shape is the sender's; bytes agree
    ([ROUTING, {**PIXELS, "dtype": "u2"}], "ok"),
    ([ROUTING, {**PIXELS, "dtype": "f4"}], "length"),
    ([ROUTING, {**PIXELS, "shape": [2, 3, 10**30]}], "extras"),  # orjson: a float
    ([ROUTING, {**PIXELS, "shape": [2, 3, 2**63]}], "length"),   # past int64 in C
    ([ROUTING, {**PIXELS, "shape": [2**63, 0]}], "length"),      # zero items, 12 bytes
    ([ROUTING, {**PIXELS, "shape": [2**40, 2**40]}], "length"),
    ([{**ROUTING, "shape": [37, 2, 2]}, PIXELS], "length"),
    ([PIXELS, ROUTING], "length"),  # frames in declaration order
    ([{**ROUTING, "extra": "key"}, PIXELS], "ok"),
])
def test_extras_rules_agree(extras: object, reason: str) -> None:
    result = assert_agree(pack_group(with_extras(make_extra_frames(), extras)))
    assert (result[0] if isinstance(result, tuple) else "ok") == reason


def test_too_many_extras_agree() -> None:
    frames = make_frames()
    many = [{"name": f"x{i}", "dtype": "u1", "shape": [1]} for i in range(17)]
    result = assert_agree(pack_group([*with_extras(frames, many), *[b"\0"] * 17]))
    assert result[0] == "extras"
    result = assert_agree(pack_group([*with_extras(frames, many[:16]), *[b"\0"] * 16]))
    assert isinstance(result, GroupFacts)


def test_random_corruptions_of_a_group_with_extras_agree() -> None:
    reasons = corruption_outcomes(pack_group(make_extra_frames(tokens=9, samples=2)), seed=11)
    assert {"ok", "frames", "header"} <= reasons
