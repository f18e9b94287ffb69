"""On-call readers of the report API, as a child process: `readers` concurrent loops of GET over
`paths` (e.g. /plan and /api/report) for `duration_s`, each as fast as it is answered, ignoring
Retry-After, as a load tool would. bench/report_readers.py and the fault suite run it.

    python -m fleetplan.harness.report_readers CONFIG.json

CONFIG: {"url", "paths", "readers", "duration_s", "out"}; written to `out`: answers by status
("503 without Retry-After" counted apart from "503"; a connection error by its exception's name),
latency p50/p99 (s), and (sent unix time, cycle_id) of each /api/report answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

CYCLE_ID = re.compile(rb'"cycle_id": (\d+|null)')
NO_RETRY_AFTER = "503 without Retry-After"


async def readers_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    url, paths, n = cfg["url"], cfg["paths"], int(cfg["readers"])
    until = time.time() + float(cfg["duration_s"])
    status: Counter[str] = Counter()
    latency: list[float] = []
    seen: list[tuple[float, int]] = []  # (sent, cycle_id) of each /api/report answer

    async def reader(i: int, http: aiohttp.ClientSession) -> None:
        k = i
        while time.time() < until:
            path = paths[k % len(paths)]
            k += 1
            sent = time.time()
            try:
                async with http.get(url + path) as r:
                    body = await r.read()
                    status[NO_RETRY_AFTER if r.status == 503 and "Retry-After" not in r.headers
                           else str(r.status)] += 1
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                status[type(exc).__name__] += 1
                await asyncio.sleep(0.1)
                continue
            latency.append(time.time() - sent)
            if r.status == 200 and path == "/api/report":
                m = CYCLE_ID.search(body, 0, 4096)
                if m is not None and m.group(1) != b"null":
                    seen.append((sent, int(m.group(1))))

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        await asyncio.gather(*(reader(i, http) for i in range(n)))
    latency.sort()
    pct = {q: latency[min(len(latency) - 1, int(q / 100 * len(latency)))] if latency else math.nan for q in (50, 99)}
    return {"status": dict(status), "p50_s": pct[50], "p99_s": pct[99], "seen": seen}


def readers_child(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    out = asyncio.run(readers_main(cfg))
    Path(cfg["out"]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(readers_child(sys.argv[1]))
