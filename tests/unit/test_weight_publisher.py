"""WeightPublisher: the caller keeps heart-beating while it waits for a slow delivery, whatever
the call that waits (the next publish, a re-send to late joiners, the close)."""

from __future__ import annotations

import threading

import pytest

from asyncrl.weights.publisher import WeightPublisher


class SlowBroadcaster:
    """A broadcaster whose every sync lasts until ``release`` is set (engines joining)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.synced: list[int] = []
        self.closed = False

    def sync(self, state, version: int) -> dict[str, float]:
        assert self.release.wait(30.0), "the test never released the sync"
        self.release.clear()  # one release, one sync
        self.synced.append(version)
        return {"weights/members": 1.0}

    def needs_sync(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


class Versions:
    def __init__(self) -> None:
        self.published: list[int] = []

    def publish_version(self, version: int) -> None:
        self.published.append(version)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("overlap", [True, False])
def test_caller_beats_while_waiting_for_a_delivery(overlap: bool) -> None:
    broadcaster, control = SlowBroadcaster(), Versions()
    beats: list[threading.Thread] = []
    release_at = [3]  # the delivery waited for ends at this beat (engines finished joining)

    def beat() -> None:
        beats.append(threading.current_thread())
        if len(beats) == release_at[0]:  # once: the next delivery waits for its own
            broadcaster.release.set()

    publisher = WeightPublisher(control, broadcaster, overlap=overlap,  # type: ignore[arg-type]
                                beat=beat, beat_s=0.01)
    publisher.publish({}, 1)
    if overlap:  # the next publish is what waits for version 1, then version 2 is in flight
        assert not beats
        publisher.publish({}, 2)
    assert len(beats) >= 3 and set(beats) == {threading.current_thread()}
    assert control.published == [1]

    if overlap:
        release_at[0] = len(beats) + 3
        assert publisher.wait()["weights/members"] == 1.0
        assert len(beats) >= release_at[0] and control.published == [1, 2]
    release_at[0] = len(beats) + 3
    assert publisher.resync({}, 2 if overlap else 1)  # a late joiner: the version re-sent
    assert len(beats) >= release_at[0] and set(beats) == {threading.current_thread()}
    publisher.close()
    assert broadcaster.closed and broadcaster.synced == ([1, 2, 2] if overlap else [1, 1])
    assert control.published == ([1, 2] if overlap else [1]), "a re-send publishes nothing"


def test_a_failed_beat_does_not_end_the_wait() -> None:
    broadcaster = SlowBroadcaster()

    def beat() -> None:
        broadcaster.release.set()
        raise TimeoutError("buffer restarting")

    publisher = WeightPublisher(Versions(), broadcaster, overlap=False,  # type: ignore[arg-type]
                                beat=beat, beat_s=0.01)
    publisher.publish({}, 1)
    assert broadcaster.synced == [1]


@pytest.mark.parametrize("joined", [False, True])
def test_the_figures_of_a_delivery_outlive_a_wait_for_data(joined: bool) -> None:
    """The learner re-syncs late joiners on every empty poll for data, which waits for the
    overlapped delivery: its figures used to be dropped there, and the next step's record
    had no ``weights/*``. A re-send (an engine joined) adds none of its own."""
    broadcaster, control = SlowBroadcaster(), Versions()
    broadcaster.needs_sync = lambda: joined  # type: ignore[method-assign]
    broadcaster.release.set()
    publisher = WeightPublisher(control, broadcaster)  # type: ignore[arg-type]
    publisher.publish({}, 1)   # version 1 in flight while the learner waits for data
    if joined:   # the re-send's own sync
        threading.Timer(0.2, broadcaster.release.set).start()
    assert publisher.resync({}, 1) is joined
    broadcaster.release.set()
    record = publisher.publish({}, 2)   # the next step's record: version 1's figures
    assert record["weights/version"] == 1.0 and record["weights/members"] == 1.0
    publisher.close()
    assert control.published == [1, 2]
