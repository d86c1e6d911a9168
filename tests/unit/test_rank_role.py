"""Rank 0's role and the other ranks' answer the same interface, so the learner's step calls
the same methods on every rank (``learners.loop._train`` has no branch on the rank)."""

from __future__ import annotations

import inspect
import threading

from learners.lost import Lost
from learners.rank_role import OtherRank, RankRole
from learners.rank_zero import RankZero


def _methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(cls).items()
            if callable(member) and not name.startswith("_")}


def test_both_roles_have_every_method_of_the_interface_with_its_parameters() -> None:
    interface = _methods(RankRole)
    assert interface   # the protocol declares them
    for role in (RankZero, OtherRank):
        for name, signature in interface.items():
            assert list(inspect.signature(getattr(role, name)).parameters) == \
                list(signature.parameters), (role.__name__, name)


def test_the_other_ranks_hold_nothing_and_never_stop_the_run() -> None:
    """Their answers are what the step's agreements read as "nothing from this rank"."""
    role, lost = OtherRank(), Lost()
    assert role.poll(3, threading.Event(), lost) == (False, False)
    with role.leased() as batch:
        assert batch is None
    assert role.ack(4, {}, lost) == {} and role.next_shares(4) is None
    assert role.publish(4, {}, {}, {}, {}, lost) is False
    assert role.reached is None and role.last_record == {}


def test_rank_zero_heartbeats_say_which_engines_the_weight_sync_evicted() -> None:
    """Every heartbeat of the learner carries its last record (``last_record``); it also says
    which engines the broadcaster evicted and why, for the monitor, while the record written
    to the metrics stays numbers only."""
    from types import SimpleNamespace

    from asyncrl.snapshot import EVICTIONS

    notes: dict[str, str] = {}
    role = object.__new__(RankZero)  # only what last_record reads: no buffer, no broadcaster
    role.publisher = SimpleNamespace(broadcaster=SimpleNamespace(evictions=lambda: notes))
    role._record = {"step": 7, "actor/loss": 0.5}
    assert role.last_record == {"step": 7, "actor/loss": 0.5}
    notes["rollout-1-42"] = "no heartbeat for 2.6 s during version 7 (frozen?)"
    assert role.last_record == {"step": 7, "actor/loss": 0.5, EVICTIONS: notes}
    assert EVICTIONS not in role._record
