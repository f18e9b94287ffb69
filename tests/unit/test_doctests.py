"""The worked examples in the pure cores' docstrings are executed: an example that drifts from the
code fails here instead of misleading the next reader."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

from fleetplan import models, planner

MODULES = [*sorted(f"{pkg.__name__}.{m.name}" for pkg in (planner, models)
                   for m in pkgutil.iter_modules(pkg.__path__)),
           # adapters' modules whose docstrings carry a worked example
           "fleetplan.sim.graduation", "fleetplan.sim.jobs", "fleetplan.harness.demo_day", "fleetplan.controller.page",
           "fleetplan.harness.demo_summary"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
