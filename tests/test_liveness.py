"""The heartbeat rule (core/liveness.py) at its boundaries; the roles' use of it is in
tests/roles/ (a silent peer declared dead, a stall that is ours)."""

from __future__ import annotations

from pdxfer.core.config import Config
from pdxfer.core.liveness import IDLE_SECONDS, Heartbeats, resumed
from pdxfer.core.protocol import Role

RULE = Heartbeats(interval=0.5, misses=4)  # a bound of 2 s: every time below is exact in binary


def test_the_bound_is_the_misses_in_intervals_and_the_config_gives_its_rule():
    assert RULE.bound == 2.0
    config = Config(role=Role.DECODE, heartbeat_interval=0.25, heartbeat_misses=3)
    assert config.heartbeats == Heartbeats(0.25, 3) and config.silence_bound == 0.75


def test_a_peer_is_dead_only_past_the_bound():
    assert not RULE.dead(last_heard=100.0, now=102.0)  # exactly the bound: alive
    assert RULE.dead(last_heard=100.0, now=102.0 + 2**-20)
    assert not RULE.dead(last_heard=100.0, now=99.0)  # heard after the tick began


def test_a_heartbeat_is_due_once_an_interval_passed_and_at_once_on_a_new_link():
    assert not RULE.due(last_beat=100.0, now=100.5 - 2**-20)
    assert RULE.due(last_beat=100.0, now=100.5)
    assert RULE.due(last_beat=0.0, now=100.0)


def test_a_heartbeat_was_missed_when_nothing_came_since_it_left():
    assert RULE.missed(beats=3, last_beat=100.0, last_heard=99.5)
    assert not RULE.missed(beats=3, last_beat=100.0, last_heard=100.0)  # heard as it left: an answer to an earlier one, or anything
    assert not RULE.missed(beats=0, last_beat=0.0, last_heard=0.0)  # none sent yet


def test_this_daemon_stood_still_when_it_did_not_look_for_over_half_the_bound():
    assert not RULE.stood_still(last_look=100.0, now=101.0)  # exactly half: not yet
    assert RULE.stood_still(last_look=100.0, now=101.0 + 2**-20)
    assert not RULE.stood_still(last_look=0.0, now=1_000.0)  # the first look


def test_a_peer_resumes_from_now_after_a_stall_unless_heard_later():
    assert resumed(last_heard=90.0, now=100.0) == 100.0
    assert resumed(last_heard=100.5, now=100.0) == 100.5


def test_an_idle_link_closes_after_ten_bounds_or_the_idle_floor_whichever_is_longer():
    assert IDLE_SECONDS > 10 * RULE.bound
    assert not RULE.idle(last_heard=0.0, now=IDLE_SECONDS)
    assert RULE.idle(last_heard=0.0, now=IDLE_SECONDS + 2**-10)
    slow = Heartbeats(interval=4.0, misses=2)  # ten bounds: 80 s, past the floor
    assert not slow.idle(last_heard=0.0, now=80.0) and slow.idle(last_heard=0.0, now=80.0 + 2**-10)
