"""The policy and profile files as the controller holds them: read, validated, reloaded on SIGHUP
(off the event loop: a huge or hostile file must not stall MQTT and the cycle); the last good
policy stays on any error, and the error shows in reports and alerts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetplan.controller.metrics import ControllerMetrics
from fleetplan.controller.state import StateStore
from fleetplan.planner.act_types import AlertKey, AlertKind

log = logging.getLogger(__name__)


def live_refusals(policy: Any, *, pool_proxy: bool) -> list[str]:
    """What a live controller cannot run of `policy`: a model allowed disaggregated pools is served
    through the pool proxy (the controller writes its upstreams file and puts it in the model's nginx
    upstream), so without a proxy configured (`pool_proxy` False: no `routing.pool_proxy` in the
    controller config) a policy that allows pools is refused."""
    if pool_proxy:
        return []
    return [f"models[{i}].disaggregation.allowed = true: no pool proxy is configured to send the model's "
            "requests to its prefill and decode pools; set routing.pool_proxy in the controller config (the "
            "proxy's upstreams_path and address, docs/controller.md), or disaggregation.allowed false"
            for i, m in enumerate(policy.models) if m.disaggregation.allowed]


@dataclass
class PolicySource:
    path: Path
    profiles_path: Path | None
    store: StateStore
    metrics: ControllerMetrics
    alerts: MutableMapping[AlertKey, str]
    policy: Any = None  # the last good planner.policy.Policy
    profiles: Any = None  # the last good models.profile.ProfileSet
    loaded_s: float | None = None  # wall
    error: str | None = None
    wall: Callable[[], float] = time.time
    pool_proxy: bool = False  # the controller config names a pool proxy (routing.pool_proxy)
    _reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def read(self) -> Any:
        """Read + parse + validate the policy file (touches no state: runs in a thread).
        Raises PolicyError naming the file, the field and the value."""
        from fleetplan.planner.policy import MAX_POLICY_BYTES, PolicyError, load_policy_text

        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_POLICY_BYTES + 1)
            text = raw.decode("utf-8")
        except OSError as exc:
            raise PolicyError(str(self.path), [f"cannot read: {exc.strerror or exc}"]) from None
        except UnicodeDecodeError as exc:
            raise PolicyError(str(self.path), [f"byte {exc.start} = {raw[exc.start:exc.start + 1]!r}: "
                                               "not UTF-8"]) from None
        policy = load_policy_text(text, str(self.path))
        unroutable = live_refusals(policy, pool_proxy=self.pool_proxy)
        if unroutable:
            raise PolicyError(str(self.path), unroutable)
        return policy

    def load(self, *, initial: bool) -> bool:
        """Read + validate the policy file; on error keep the old policy (or fail at start)."""
        from fleetplan.planner.policy import PolicyError

        try:
            policy = self.read()
        except PolicyError as exc:
            return self._rejected(str(exc), initial=initial)
        self._apply(policy, initial=initial)
        return True

    async def reload(self) -> bool:
        """SIGHUP: the policy (parsed in a worker thread), then the profiles."""
        from fleetplan.planner.policy import PolicyError

        async with self._reload_lock:
            try:
                policy = await asyncio.to_thread(self.read)
            except PolicyError as exc:
                return self._rejected(str(exc), initial=False)
            except Exception as exc:  # a parser bug: still keep the last good policy
                log.exception("policy reload failed")
                return self._rejected(f"{self.path}: {type(exc).__name__}: {exc}", initial=False)
            self._apply(policy, initial=False)
            self.load_profiles()
            return True

    def _rejected(self, msg: str, *, initial: bool) -> bool:
        self.error = msg
        self.store.set_kv("policy_error", {"error": msg, "at_s": self.wall()})
        self.metrics.policy_reloads.labels("rejected").inc()
        if initial:
            raise SystemExit(msg) from None
        log.error("policy reload rejected, keeping the previous policy: %s", msg)
        self.alerts[AlertKey(AlertKind.POLICY)] = f"policy reload rejected (previous policy kept): {msg}"
        return False

    def _apply(self, policy: Any, *, initial: bool) -> None:
        self.policy = policy
        self.loaded_s = self.wall()
        self.error = None
        self.store.set_kv("policy_error", None)
        self.alerts.pop(AlertKey(AlertKind.POLICY), None)
        self.metrics.policy_reloads.labels("initial" if initial else "ok").inc()
        log.info("policy loaded from %s (%d models)", self.path, len(policy.models))

    def load_profiles(self) -> None:
        from fleetplan.models.profile import ProfileSet

        if self.profiles_path is None:
            self.profiles = ProfileSet()
            return
        from fleetplan.shared.benchfiles import load_profiles

        try:
            self.profiles = load_profiles(self.profiles_path)
        except Exception as exc:
            if self.profiles is None:
                raise SystemExit(str(exc)) from None
            self.alerts[AlertKey(AlertKind.PROFILES)] = f"profiles reload failed (previous kept): {exc}"

    def model_names(self) -> list[str]:
        return [m.name for m in self.policy.models]

    def canonical(self, name: str) -> str:
        return str(self.policy.aliases().canonical(name))

    def advisory(self) -> bool:
        from fleetplan.planner.brakes import Mode

        return self.policy is not None and bool(self.policy.mode is Mode.ADVISORY)
