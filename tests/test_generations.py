"""core/generations.py: which generations of a decode daemon's sessions a room may be
written into, when they have all ended, and when a rotation ends the old ones."""

from __future__ import annotations

import pytest

from pdxfer.core.generations import Generations, Rotation, Span, fence_due

A, B, C = ("h:1",), ("h:2", "h:3"), ("h:4",)


def test_a_room_is_fenced_only_once_every_generation_it_spans_ended():
    gens = Generations.starting(A)
    assert (gens.current, gens.sessions) == (1, A)
    room = Span(1, 1)
    assert gens.rotated(B) == 2 and gens.sessions == B
    moved = room.moved(2)  # a hello listed it live in generation 2
    assert moved == Span(1, 2) and room.moved(1) == room
    assert gens.ended(A) == 1 and gens.ended(A) is None  # once
    assert gens.all_ended(room) and not gens.all_ended(moved)
    assert gens.rotated(C) == 3 and gens.number(B) == 2 and gens.number(A) is None
    assert gens.ended(B) == 2 and gens.all_ended(moved) and not gens.all_ended(Span(3, 3))


def test_a_rotation_is_due_once_every_prefill_drained_or_at_its_deadline_and_only_once():
    rotation = Rotation(old=1, sessions=A, reason="r", started=10.0, deadline=20.0, waiting={"p", "q"})
    assert not rotation.due(11.0)
    assert not rotation.drained("p") and not rotation.due(11.0)
    assert rotation.drained("q") and rotation.due(11.0)
    late = Rotation(old=1, sessions=A, reason="r", started=10.0, deadline=20.0, waiting={"p"})
    assert not late.due(19.999) and late.due(20.0)
    late.ending = True
    assert not late.due(25.0)


@pytest.mark.parametrize("failed_at, last_heard, due", [
    (12.0, 10.0, 25.0),  # a silent prefill: from its last word
    (12.0, 14.0, 27.0),  # one still in touch that never confirms: from the failure
    (12.0, 12.0, 27.0),
])
def test_a_fence_is_due_the_bound_after_the_failure_or_after_the_prefills_last_word_if_earlier(failed_at, last_heard, due):
    assert fence_due(failed_at, last_heard, 15.0) == due
