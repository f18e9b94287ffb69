"""Helpers for the tests of the alert rules and the Grafana dashboard: which metric names the
controller exports (a fresh ControllerMetrics registry) and which ones a PromQL expression reads."""

from __future__ import annotations

import re

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}
_NAME = re.compile(r"(?<![A-Za-z0-9_:])fleetplan_[A-Za-z0-9_]+")


def controller_metric_names() -> set[str]:
    """Every sample name the controller's registry can expose, labelled children or not."""
    from fleetplan.controller.metrics import ControllerMetrics

    out: set[str] = set()
    for family in ControllerMetrics().registry.collect():
        out.update(family.name + s for s in _SUFFIXES[family.type])
    return out


def fleetplan_names(expr: str) -> set[str]:
    """The fleetplan_* metric names a PromQL expression reads."""
    return set(_NAME.findall(expr))
