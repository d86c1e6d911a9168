"""How the ZMQ broker admits puts: in order, one result per group, waiting while it is full.

A ``put`` carries one packed group, a ``put_many`` several (one frame each, so a producer
pays one round trip for a chunk of groups instead of one per group). Every group is checked
on arrival (a rejection is counted at once and keeps its place among the results); the valid
ones are accepted in order while the broker holds fewer than ``max_groups``. What does not
fit waits, as a :class:`~buffers.zmq_waits.PutJob`, behind every put that waits already, so
puts stay FIFO per producer; the request is answered when all its groups have a result, or
with ``full`` after its timeout (its groups are then in doubt, see the protocol). Once the run
is done nothing waits: every group is refused (``run``) at once, the waiting ones as soon as
the run status changes (as Redis does), not after the timeout, which the rollout role took
for failed workers at the end of a finished run.
"""

from __future__ import annotations

from collections.abc import Callable

from buffers.zmq_protocol import Reply, Request, arg_refusals, arg_str
from buffers.zmq_state import BrokerState, QueuedGroup
from buffers.zmq_waits import Parked, PutJob, Waits, park


class PutDesk:
    """Puts for one broker: ``answer`` sends a parked request's reply, ``serve_batches``
    hands newly accepted groups to waiting consumers."""

    def __init__(self, state: BrokerState, waits: Waits, answer: Callable[[Parked, Reply], None],
                 serve_batches: Callable[[], None], timeout_s: float) -> None:
        self._state, self._waits, self._answer = state, waits, answer
        self._serve_batches, self._timeout_s = serve_batches, timeout_s

    def put(self, request: Request, single: bool) -> Reply | None:
        """A ``put`` (its payload must be exactly one packed group, or ``frames``) or a
        ``put_many``; the reply now, or None when it waits for room."""
        producer = arg_str(request.args, "producer")
        self._state.require_member(producer)
        self._state.members.touch(producer)  # once per request, not once per group
        job = PutJob(producer, self._checked(producer, request, single), single)
        if not self._waits.puts and self._advance(job):
            return _reply(job)
        parked = park(request, producer, self._state.clock(), default_timeout_s=self._timeout_s)
        parked.job = job
        self._waits.add_put(parked)
        return None

    def _checked(self, producer: str, request: Request, single: bool
                 ) -> list[QueuedGroup | str]:
        """Each group checked (or its rejection reason), in order. A group its client
        refused to send (over ``max_message_bytes``) is counted as its check would be."""
        refused = arg_refusals(request.args, len(request.payload))
        if single:  # exactly one group (check_put refuses any other count)
            one = len(request.payload) == 1 and 0 in refused
            return [self._state.refuse_oversized(producer, refused[0]) if one
                    else self._state.check(producer, request.payload)]
        return [self._state.refuse_oversized(producer, refused[i]) if i in refused
                else self._state.check(producer, [frame])
                for i, frame in enumerate(request.payload)]

    def admit_parked(self) -> None:
        """Accept waiting puts in arrival order while there is room (FIFO per producer)."""
        while self._waits.puts and self._state.answers_puts():
            parked = self._waits.puts[0]
            assert parked.job is not None
            self._state.members.touch(parked.job.producer)  # still there: it waits
            if not self._advance(parked.job):
                return
            self._waits.pop_put(self._state.clock())
            self._answer(parked, _reply(parked.job))

    def _advance(self, job: PutJob) -> bool:
        """Give ``job``'s groups their results in order while there is room; True when all
        have one. Batches waiting for groups are served as soon as some were accepted."""
        accepted = 0
        while not job.done:
            item = job.next_item()
            if isinstance(item, str):  # rejected when checked: its result keeps its place
                job.results.append((False, item))
                continue
            if not self._state.answers_puts():
                break
            reason = self._state.accept(job.producer, item)
            job.results.append((not reason, reason))
            accepted += not reason
        if accepted:
            self._serve_batches()
        return job.done


def _reply(job: PutJob) -> Reply:
    if job.single:
        accepted, reason = job.results[0]
        return Reply(True, {"accepted": accepted, "reason": reason})
    return Reply(True, {"results": [list(result) for result in job.results]})
