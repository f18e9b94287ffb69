"""The daemon's interval loop (controller/daemon.py `_cycle_loop`): a reload asked for during a
cycle is applied after it, never inside; a stop lets the current cycle finish; cycles never
overlap. The controller here is a stand-in recording calls (the loop is what is tested)."""

from __future__ import annotations

import asyncio

from fleetplan.controller.runner import Signals, _cycle_loop


class Recorder:
    def __init__(self, sig: Signals, *, reload_at: int | None = None, stop_at: int | None = None) -> None:
        self.sig = sig
        self.events: list[str] = []
        self.running = False
        self.reload_at = reload_at
        self.stop_at = stop_at

    async def cycle(self) -> dict[str, object]:
        assert not self.running  # never two at once
        self.running = True
        n = sum(1 for e in self.events if e.endswith("start"))
        self.events.append(f"cycle{n} start")
        if n == self.reload_at:
            self.sig.reload = True  # SIGHUP arrives mid-cycle
            self.sig.wake.set()
        if n == self.stop_at:
            self.sig.stop = True  # SIGTERM arrives mid-cycle
            self.sig.wake.set()
        await asyncio.sleep(0.01)
        self.events.append(f"cycle{n} end")
        self.running = False
        return {}

    async def reload_policy(self) -> bool:
        assert not self.running  # between cycles, never inside one
        self.events.append("reload")
        return True


async def test_a_reload_during_a_cycle_is_applied_right_after_it() -> None:
    sig = Signals()
    ctrl = Recorder(sig, reload_at=0, stop_at=1)
    await asyncio.wait_for(_cycle_loop(ctrl, sig, lambda: 0.05), 5.0)  # type: ignore[arg-type]
    assert ctrl.events == ["cycle0 start", "cycle0 end", "reload", "cycle1 start", "cycle1 end"]


async def test_a_stop_lets_the_current_cycle_finish_and_no_other_starts() -> None:
    sig = Signals()
    ctrl = Recorder(sig, stop_at=2)
    await asyncio.wait_for(_cycle_loop(ctrl, sig, lambda: 0.02), 5.0)  # type: ignore[arg-type]
    assert ctrl.events[-2:] == ["cycle2 start", "cycle2 end"] and len(ctrl.events) == 6
