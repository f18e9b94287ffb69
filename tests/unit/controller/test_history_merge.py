"""The rate history is read once and then extended by the steps since (controller/observe.py)."""

from __future__ import annotations

from fleetplan.controller.observe import Series, merge_history


def test_new_steps_extend_the_old_series_and_replace_the_last_one() -> None:
    a = {"model_name": "a"}
    old = (Series(a, ((0.0, 1.0), (300.0, 2.0), (600.0, 3.0))),)
    new = (Series(a, ((600.0000001, 3.5), (900.0, 4.0))), Series({"model_name": "b"}, ((900.0, 9.0),)))
    merged = {s.labels["model_name"]: s.points for s in merge_history(old, new, since_s=300.0)}
    assert merged == {"a": ((300.0, 2.0), (600.0, 3.5), (900.0, 4.0)), "b": ((900.0, 9.0),)}


def test_a_series_older_than_the_span_is_dropped() -> None:
    old = (Series({"model_name": "gone"}, ((0.0, 1.0),)),)
    assert merge_history(old, (), since_s=10.0) == ()
