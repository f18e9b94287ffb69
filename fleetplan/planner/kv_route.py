"""Which decode replica receives a request's KV cache after its prefill: one rule for the live pool
proxy (controller/pool_proxy.py) and the replay's (sim/disagg_proxy.py).

Why a rule at all: a prefill replica's KV cache moves to the decode replica over NVLink when both
share a host, else over the network (models/disagg.py `kv_transfer_ms`: 10-40x slower per byte), and
placement pairs the pools on hosts for that (planner/placement.py). A least-loaded pick over every
decode replica throws the pairing away: with n hosts it lands on the prefill's host one time in n.
So the pick prefers a decode replica on the prefill's host while its load stays under `balance` x
(the mean load + 1), rounded up (bounded-load hashing's bound, sim/router.py, counting the request
being placed in each replica's mean: at one or two requests per replica a decode step costs the
same, and the strict bound would send every other request over the network), and is the least
loaded anywhere when none on the host is within it: locality never piles requests on one replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["KV_BALANCE", "decode_choices"]

KV_BALANCE = 1.25  # a same-host decode replica is preferred up to this x the mean load


def decode_choices(loads: Sequence[int], hosts: Sequence[str | None], src_host: str | None,
                   balance: float = KV_BALANCE) -> tuple[int, ...]:
    """Indices of the decode replicas the request may go to (all tied: the caller breaks the tie,
    the replay by the first, the live proxy at random); () when there is none. `loads[i]`: requests
    in replica i; `hosts[i]`: its host (None: unknown); `src_host`: the prefill replica's host.

    >>> decode_choices([3, 1, 2], ["a", "b", "a"], "a")   # on the prefill's host, within 1.25 x the mean
    (2,)
    >>> decode_choices([2, 0, 0], ["a", "b", "b"], "a")   # under ceil(1.25 x (2/3 + 1)) = 3
    (0,)
    >>> decode_choices([8, 1, 8], ["a", "b", "a"], "a")   # the host's replicas at ceil(1.25 x (17/3 + 1)) = 9
    (0, 2)
    >>> decode_choices([10, 1, 10], ["a", "b", "a"], "a")  # at the bound, ceil(1.25 x (21/3 + 1)) = 10: no
    (1,)
    >>> decode_choices([2, 2, 4], ["b", "c", "b"], "a")   # none on the host: the least loaded
    (0, 1)
    >>> decode_choices([2, 2], [None, None], None)         # hosts unknown: the least loaded
    (0, 1)
    """
    n = len(loads)
    if n == 0:
        return ()
    if len(hosts) != n:
        raise ValueError(f"{n} decode replicas but {len(hosts)} hosts")
    pool = range(n)
    if src_host is not None:
        bound = math.ceil(balance * (sum(loads) / n + 1))
        near = [i for i in pool if hosts[i] == src_host and loads[i] < bound]
        if near:
            pool = near  # type: ignore[assignment]
    least = min(loads[i] for i in pool)
    return tuple(i for i in pool if loads[i] == least)
