"""Which versions the groups in flight were granted at: what ``pace`` mode waits on.

A producer asks the gate with its engine's version (``acquire(..., engine_version)``); every
token the group gets later is at least that new, so the grant's version is a lower bound on the
group's oldest version, known before the group exists. ``pace``
(:func:`asyncrl.staleness.pace_allows`) counts these bounds with the queued groups.

Groups finish out of order and a put does not say which grant it settles, so the bookkeeping
errs on the old side: a put settles the producer's newest grant not newer than the group's own
oldest version (a group cannot be older than its grant), a release (filtered, failed) its
newest grants. An old grant so kept too long only makes the learner wait until the producer's
groups are all in, never skip a group; when a producer has nothing in flight its record is
empty. The Redis scripts keep the same record in Lua (``buffers.redis_data_scripts``).
"""

from __future__ import annotations

from collections import Counter


class InFlightVersions:
    """Per producer, how many groups in flight were granted at each version."""

    def __init__(self) -> None:
        self._by_producer: dict[str, Counter[int]] = {}

    def grant(self, producer: str, version: int, count: int) -> None:
        if count > 0:
            self._by_producer.setdefault(producer, Counter())[version] += count

    def settle(self, producer: str, oldest: int) -> None:
        """One group of ``producer`` whose oldest token version is ``oldest`` is in (or was
        rejected): forget the newest grant at or below ``oldest``, else the oldest grant."""
        grants = self._by_producer.get(producer)
        if not grants:
            return
        below = [v for v in grants if v <= oldest]
        self._take(producer, max(below) if below else min(grants))

    def release(self, producer: str, count: int) -> None:
        """``count`` grants of ``producer`` will never be put: forget its newest ones."""
        for _ in range(count):
            grants = self._by_producer.get(producer)
            if not grants:
                return
            self._take(producer, max(grants))

    def forget(self, producer: str) -> None:
        """A dead producer's grants went back to the gate."""
        self._by_producer.pop(producer, None)

    def keep_at_most(self, producer: str, count: int) -> None:
        """Trim ``producer``'s record to the gate's own count of its groups in flight (the
        gate clamps its count at 0; the record follows it), dropping the newest first."""
        grants = self._by_producer.get(producer)
        if grants:
            self.release(producer, max(0, sum(grants.values()) - count))

    def producers(self) -> list[str]:
        return list(self._by_producer)

    def totals(self) -> Counter[int]:
        """Groups in flight by grant version, over every producer."""
        total: Counter[int] = Counter()
        for grants in self._by_producer.values():
            total.update(grants)
        return total

    def _take(self, producer: str, version: int) -> None:
        grants = self._by_producer[producer]
        grants[version] -= 1
        if grants[version] <= 0:
            del grants[version]
        if not grants:
            del self._by_producer[producer]
