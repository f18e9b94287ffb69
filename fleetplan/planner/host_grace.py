"""When a host counts as there: online, or offline for less than the grace (an agent restart is
not a lost host). Pure; the daemon's host book (controller/hosts.py), the planner's inventory
(planner/fleetview.py) and the act core (`HostReport.lost`) all ask `within_grace`.

>>> within_grace(True, None, now_s=100.0, grace_s=60.0)
True
>>> within_grace(False, 50.0, now_s=100.0, grace_s=60.0)  # offline for 50 s: an agent restart
True
>>> within_grace(False, 40.0, now_s=100.0, grace_s=60.0)  # offline for 60 s: lost
False
>>> within_grace(False, None, now_s=100.0, grace_s=60.0)  # offline since an unknown time
True
"""

from __future__ import annotations

__all__ = ["within_grace"]


def within_grace(online: bool, offline_since_s: float | None, *, now_s: float, grace_s: float) -> bool:
    """Online, or offline for less than `grace_s` (`offline_since_s` None: since when is unknown,
    and the host is not given up on)."""
    if online or offline_since_s is None:
        return True
    return now_s - offline_since_s < grace_s
