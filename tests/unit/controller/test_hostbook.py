"""HostBook: the act core's view of each host follows every status (reports are cached per status)."""

from __future__ import annotations

from fleetplan.controller.hosts import HostBook
from fleetplan.controller.protocol import HostStatus


def test_reports_follow_each_status_and_the_offline_time() -> None:
    now = [1000.0]
    book = HostBook(alerts={}, offline_grace_s=60.0, wall=lambda: now[0])
    book.on_status("h1", HostStatus(host="h1", online=True, gpu_count=8))
    first = book.reports()["h1"]
    assert first.online and first.gpu_count == 8
    assert book.reports()["h1"] is first  # unchanged host: the same report, not rebuilt
    now[0] = 1010.0
    book.on_status("h1", HostStatus(host="h1", online=False))  # the last will
    gone = book.reports()["h1"]
    assert not gone.online and gone.offline_since_s == 1010.0 and gone.gpu_count == 8  # keeps what it had
    assert gone.lost(1071.0, 60.0) and not gone.lost(1030.0, 60.0)
    now[0] = 1020.0
    book.on_status("h1", HostStatus(host="h1", online=True, gpu_count=4))
    back = book.reports()["h1"]
    assert back.online and back.offline_since_s is None and back.gpu_count == 4
    book.on_status("h2", HostStatus(host="h2", online=True))
    assert set(book.reports()) == {"h1", "h2"}
