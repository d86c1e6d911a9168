"""Whom the weight broadcaster sends to and gives up on (:mod:`asyncrl.weights.membership`),
on control-plane member lists as ``status()`` returns them."""

from __future__ import annotations

from asyncrl.weights.membership import SILENT_MIN_S, Membership


def rollout(seen_s_ago: float, alive: bool = True, **info: object) -> dict:
    return {"role": "rollout", "alive": alive, "last_seen_s_ago": seen_s_ago, "info": info}


def test_silent_is_half_the_timeout_but_never_a_heartbeat_or_two() -> None:
    assert Membership(timeout_s=60.0).silent_s == 30.0
    assert Membership(timeout_s=1.0).silent_s == SILENT_MIN_S


def test_lost_members_are_named_with_the_reason() -> None:
    """Departed (dead or stopped) and silent (alive to the buffer, not heard from for half
    of weights.timeout_s: frozen) are lost; a member heard from lately is not."""
    membership = Membership(timeout_s=5.0)
    listed = {"a": rollout(0.3), "b": rollout(2.6), "c": rollout(20.0, alive=False),
              "d": rollout(0.1, state="stopped"), "learner": {"role": "learner", "alive": True}}
    assert membership.roster(listed, now=100.0) == ["a", "b"]
    lost = membership.lost(listed, ["a", "b", "c", "d", "e"], version=7)
    assert lost == {"b": "no heartbeat for 2.6 s during version 7 (frozen?)",
                    **{name: "gone during version 7: dead or stopped on the control plane"
                       for name in ("c", "d", "e")}}


def test_an_evicted_member_is_out_until_heard_from_again() -> None:
    membership = Membership(timeout_s=5.0)
    membership.evict("b", "no heartbeat for 2.6 s during version 7 (frozen?)", now=100.0)
    assert membership.notes == {"b": "no heartbeat for 2.6 s during version 7 (frozen?)"}
    listed = {"a": rollout(0.3), "b": rollout(0.1)}
    assert membership.roster(listed, now=110.0) == ["a"], "not retried in the same sync"
    assert membership.sync_ended() == 1
    assert membership.roster({"a": rollout(0.3), "b": rollout(12.0)}, now=110.0) == ["a"]
    notes = membership.notes
    assert membership.roster(listed, now=110.0) == ["a", "b"], "heard from since: back"
    assert membership.notes == {} and notes == {"b": "no heartbeat for 2.6 s during version 7 "
                                                     "(frozen?)"}, "replaced whole, not edited"
    assert membership.sync_ended() == 0
