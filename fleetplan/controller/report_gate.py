"""How many report reads the controller answers, and how fast: nginx limit_req's shape.

At most `limit` reads are in flight (waiting their turn or being answered); beyond that a read is
refused at once (503 + Retry-After). Those admitted are answered at most `rate_rps` per second in
the order they came, the first `READ_BURST` at once: a reader that asks again as soon as it is
answered (a load tool, a script in a loop) waits its turn instead of taking the event loop the
cycle and MQTT use. Each answer is a snapshot's bytes (controller/report_snapshot.py), so the
loop's cost of the readers is at most `rate_rps` small writes a second, whatever their number.

The pacing is the generic cell rate algorithm (a virtual scheduling token bucket): each admitted
read reserves the next free slot; it waits until its slot is due.
"""

from __future__ import annotations

READ_BURST = 10  # reads answered back to back before the pacing applies


class ReadGate:
    """Admission (at most `limit` in flight) and pacing (`rate_rps`, burst READ_BURST) of reads."""

    def __init__(self, limit: int, rate_rps: float) -> None:
        if limit < 1 or not rate_rps > 0:
            raise ValueError(f"report read gate: limit {limit!r} must be >= 1 and rate_rps {rate_rps!r} > 0")
        self.limit = limit
        self.rate_rps = rate_rps
        self.inflight = 0
        self._tat = float("-inf")  # the theoretical arrival time of the next read (loop seconds)

    def admit(self) -> bool:
        """Take a slot (True) or refuse (False: `limit` reads are in flight)."""
        if self.inflight >= self.limit:
            return False
        self.inflight += 1
        return True

    def release(self) -> None:
        self.inflight -= 1

    def delay_s(self, now_s: float) -> float:
        """How long an admitted read waits before it is answered; reserves its slot.

        >>> g = ReadGate(100, rate_rps=10.0)
        >>> [round(g.delay_s(0.0), 2) for _ in range(13)][-3:]  # READ_BURST + 1 at once, then 0.1 s apart
        [0.0, 0.1, 0.2]
        >>> round(g.delay_s(10.0), 2)  # a quiet while refills the burst
        0.0
        """
        interval = 1.0 / self.rate_rps
        tat = max(self._tat, now_s)
        self._tat = tat + interval
        return max(0.0, tat - now_s - READ_BURST * interval)
