"""What the daemon's parts read of the controller (`ControllerFace`): the failsafe
(controller/failsafe.py) and the report builders (controller/reporting.py) take it instead of the
`Controller` class, so that the daemon imports its parts and no part imports the daemon."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fleetplan.controller.executor import Executor
from fleetplan.controller.hosts import HostBook
from fleetplan.controller.link import MqttLink
from fleetplan.controller.metrics import ControllerMetrics
from fleetplan.controller.observe import Snapshot
from fleetplan.controller.policy_source import PolicySource
from fleetplan.controller.settings import ControllerSettings
from fleetplan.controller.state import StateStore
from fleetplan.planner.act_types import AlertKey


class SimulatedClock(Protocol):
    def now(self) -> float: ...


class ControllerFace(Protocol):
    settings: ControllerSettings
    policy_path: Path
    store: StateStore
    time_scale: float
    metrics: ControllerMetrics
    wall: Callable[[], float]
    runtime_alerts: dict[AlertKey, str]
    policy: PolicySource
    hosts: HostBook
    link: MqttLink
    executor: Executor
    planner_state: Any
    last_snapshot: Snapshot | None
    correction_labels: set[tuple[str, str]]

    @property
    def clock(self) -> SimulatedClock: ...

    @property
    def profiles(self) -> Any: ...

    def model_names(self) -> list[str]: ...

    def advisory(self) -> bool: ...

    def build_fleet(self) -> Any: ...

    def actuation(self) -> dict[str, Any]: ...
