"""The replay's disaggregated serving: prefill and decode pools behind a simulated proxy.

A model may be served by replicas of three roles (`ConfigKey.role`): aggregated replicas run whole
requests; a prefill replica runs a request's prompt with ONE output token (vLLM's proxy sends the
prefill instance the request with `max_tokens=1`; TensorRT-LLM's context servers the same); a
decode replica receives the prompt's KV cache and decodes the output. The proxy:

1. sends each arrival to the least-loaded replica among the model's aggregated replicas and its
   prefill replicas (the one least-loaded pick of the router, `des.py`; prefill replicas are in the
   model's routable set only while the model has a READY decode replica, so a model with pools and
   no decode replica rejects as one with no replica at all);
2. when the prefill replica emits the first token, picks a decode replica of the model by the live
   proxy's rule (`planner.kv_route.decode_choices`: one on the prefill's host while its load is
   within a bound, else the least loaded; READY ones; none: one still DRAINING; none either: the
   request waits for the next decode replica to turn READY) and moves the KV cache: latency + KV bytes per token x prompt tokens /
   (TP x link efficiency x line rate) (`models.disagg.kv_transfer_ms`), over the host's link
   (`host_link`) when both replicas share a host, else the network link (`SimSettings.kv_network_link`);
3. the request joins the decode replica after the prefill's front end and the transfer, with its
   prompt's KV in place: its last prompt token is computed in the decode replica's next step, which
   emits the client's first token (vLLM's decode instance recomputes the last prompt token to get
   the logits of the first output token), then it decodes the rest; no prefill compute, KV held
   for prompt + output as in any engine.

The client's TTFT is the prefill replica's TTFT + the transfer + the decode replica's queue and
first step (+ its front end); the per-request ITL comes from the decode steps only.

What each engine exports (the metric names are the aggregated engines'): the prefill engine counts
its one-token requests (TTFT from the request's arrival, prompt tokens, one generation token); the
decode engine counts the requests it decodes (TTFT from the request's arrival at it, so including
the KV transfer, as vLLM's decode instance waits for the remote KV inside the engine; its prompt
tokens, all generation tokens, the inter-token gaps, the per-request TPOT).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

from fleetplan.models.config_key import Role
from fleetplan.models.disagg import host_link, kv_bytes_per_token, kv_transfer_ms
from fleetplan.planner.kv_route import decode_choices
from fleetplan.planner.types import ConfigKey, ReplicaState
from fleetplan.sim.core import ITL_BUCKETS_S, LENGTH_BUCKETS, TPOT_BUCKETS_S, TTFT_BUCKETS_S, FastCore
from fleetplan.sim.des_base import FleetSimBase, _SimReplica
from fleetplan.sim.des_types import PENDING, REJECTED, SERVED
from fleetplan.sim.groundtruth import EngineParams, RequestTooLongError


class DecodeCore(FastCore):
    """A decode replica's core: requests join with their prompt's KV already transferred."""

    def submit_prefilled(self, idx: int, prompt_tokens: int, max_tokens: int) -> None:
        """Queue request `idx` whose prompt KV arrived from a prefill replica: every prompt token but
        the last is computed (the step that computes the last one emits the first output token).
        Raises RequestTooLongError when prompt + output can never fit this engine."""
        s = self._enqueue(idx, prompt_tokens, max_tokens, None)
        s.computed = s.prompt - 1


def core_for(config: ConfigKey, params: EngineParams, seed: int, macro: bool) -> FastCore:
    """The core a replica of `config` runs (a decode replica's takes transferred prompts)."""
    if config.role is Role.DECODE:
        return DecodeCore(params, seed=seed, macro=macro)
    return FastCore(params, seed=seed, macro=macro)


class DisaggProxy(FleetSimBase):
    """The proxy in front of prefill and decode pools, and the pools' replicas (a mixin of `FleetSim`)."""

    prefillers: list[list[_SimReplica]]  # READY prefill replicas per model, in ready order
    decoders: list[list[_SimReplica]]  # READY decode replicas per model, in ready order
    kv_waiting: list[deque[int]]  # prefilled requests waiting for a decode replica, per model
    decode_arrival: dict[int, float]  # request -> its arrival at the decode engine (after the prefill's front end)
    kv_source: dict[int, tuple[ConfigKey, str]]  # a waiting request's prefill config and host
    kv_log: list[tuple[int, float, bool, str]]  # (request, transfer ms, across hosts, prefill host) per KV transfer
    _kv_bytes: dict[ConfigKey, float]

    def _init_pools(self) -> None:
        self.prefillers = [[] for _ in self.model_names]
        self.decoders = [[] for _ in self.model_names]
        self.kv_waiting = [deque() for _ in self.model_names]
        self.decode_arrival = {}
        self.kv_source = {}
        self.kv_log = []
        self._kv_bytes = {}

    def _stop(self, rep: _SimReplica, t: float) -> None:  # FleetWorld's
        raise NotImplementedError

    # -- membership
    def _pool_ready(self, rep: _SimReplica, t: float) -> None:
        """A pool replica turned READY (baselines; the daemon's routes: `_pool_route`)."""
        mi = rep.mi
        if rep.config.role is Role.PREFILL:
            self.prefillers[mi].append(rep)
            if self.decoders[mi]:
                self.serving[mi].append(rep)
            return
        first = not self.decoders[mi]
        self.decoders[mi].append(rep)
        if first:
            self.serving[mi].extend(self.prefillers[mi])
        self._flush(mi, t)

    def _pool_leave(self, rep: _SimReplica) -> None:
        """A pool replica leaves the proxy (draining or stopped): no new request reaches it."""
        mi = rep.mi
        pool = self.prefillers[mi] if rep.config.role is Role.PREFILL else self.decoders[mi]
        if rep in pool:
            pool.remove(rep)
        if rep in self.serving[mi]:
            self.serving[mi].remove(rep)
        if not self.decoders[mi]:  # no decode replica: the prefill replicas take no new request
            keep = [r for r in self.serving[mi] if not r.pooled]
            if len(keep) != len(self.serving[mi]):
                self.serving[mi] = keep

    def _pool_route(self, mi: int, reps: Sequence[_SimReplica], t: float) -> None:
        """The daemon's routes for model `mi`'s pool replicas (`route`, after it set the model's
        aggregated replicas in `serving`): the READY ones in `reps` serve, the others still READY drain."""
        wanted = set(map(id, reps))
        for r in self.prefillers[mi] + self.decoders[mi]:
            if id(r) not in wanted and r.state == ReplicaState.READY:
                r.state = ReplicaState.DRAINING
                r.since = t
        ready = sorted((r for r in reps if r.state == ReplicaState.READY), key=lambda r: r.seq)
        self.prefillers[mi] = [r for r in ready if r.config.role is Role.PREFILL]
        self.decoders[mi] = [r for r in ready if r.config.role is Role.DECODE]
        if self.decoders[mi]:
            self.serving[mi] = [*self.serving[mi], *self.prefillers[mi]]
            self._flush(mi, t)

    def _holds_decode(self, rep: _SimReplica) -> bool:
        """Whether a draining decode replica must stay up: the model's prefilled requests may still
        need it (no READY decode replica, and prefill replicas hold requests or requests wait)."""
        if rep.config.role is not Role.DECODE or self.decoders[rep.mi]:
            return False
        mi = rep.mi
        return bool(self.kv_waiting[mi]) or any(
            r.load > 0 for r in self.replicas
            if r.mi == mi and r.config.role is Role.PREFILL and r.state != ReplicaState.STOPPED)

    def _settle(self, mi: int, t: float) -> None:
        """Stop the model's idle draining decode replicas that no prefilled request can need."""
        for r in self.replicas:
            if (r.mi == mi and r.config.role is Role.DECODE and r.state == ReplicaState.DRAINING
                    and r.load == 0 and self.control is None and not self._holds_decode(r)):
                self._stop(r, t)

    # -- steps
    def _pool_step(self, rep: _SimReplica, t: float) -> int:
        """Apply a pool replica's step at `t`: its engine's series, prefilled requests handed to a
        decode replica, decoded requests served. Returns the requests that left the replay's
        outstanding count (served, or rejected at the hand-off)."""
        core = rep.core
        firsts, fins, gap, cnt = core.end()
        cn = rep.counters
        if cnt:
            cn.itl[bisect.bisect_left(ITL_BUCKETS_S, gap)] += cnt
        oh = core.params.factors.ttft_overhead_s
        prefill = rep.config.role is Role.PREFILL
        left = 0
        for idx in firsts:
            since = self.arr_t[idx] if prefill else self.decode_arrival[idx]
            tt = t - since + oh
            cn.ttft[bisect.bisect_left(TTFT_BUCKETS_S, tt)] += 1
            cn.sums[0] += tt
            if not prefill:
                self.first_t[idx] = t
        for idx in fins:
            if self.status[idx] != PENDING:
                continue
            rep.inflight.discard(idx)
            p = self.prompt[idx]
            o = 1 if prefill else self.output[idx]
            cn.completed += 1
            cn.prompt_tokens += p
            cn.gen_tokens += o
            cn.prompt_len[bisect.bisect_left(LENGTH_BUCKETS, p)] += 1
            cn.gen_len[bisect.bisect_left(LENGTH_BUCKETS, o)] += 1
            cn.sums[2] += p
            cn.sums[3] += o
            if prefill:
                left += self._hand_off(idx, rep, t + oh, t)
                continue
            self.finish_t[idx] = t
            self.status[idx] = SERVED
            self.decode_arrival.pop(idx, None)
            if o >= 2:
                tp = (t - self.first_t[idx]) / (o - 1)
                cn.tpot[bisect.bisect_left(TPOT_BUCKETS_S, tp)] += 1
                cn.sums[1] += tp
            left += 1
        rep.load -= len(fins)
        self._begin(rep, t)
        if rep.state == ReplicaState.DRAINING and rep.load == 0 and self.control is None:
            if not core.busy and not self._holds_decode(rep):
                self._stop(rep, t)
        if prefill and fins and self.control is None:
            self._settle(rep.mi, t)
        return left

    def _begin(self, rep: _SimReplica, t: float) -> None:
        """Start the replica's next step when idle, or split its macro-step at `t` (a request joined)."""
        core = rep.core
        if core.busy:
            if core._k > 0 and core.t_end > t:
                te_old = core.t_end
                te = core.split(t)
                if te < te_old:
                    rep.version += 1
                    self._push(te, self._P_STEP, "step", (rep, rep.version))
            return
        te2 = core.begin(t)
        if te2 is not None:
            rep.version += 1
            self._push(te2, self._P_STEP, "step", (rep, rep.version))

    # -- the hand-off
    def _hand_off(self, idx: int, src: _SimReplica, t_out: float, t: float) -> int:
        """Request `idx` left prefill replica `src` at `t_out` (its front end passed): to a decode
        replica, or to the model's queue of requests waiting for one. Returns 1 when rejected."""
        mi = src.mi
        dst = self._pick_decoder(mi, src.host)
        if dst is None:
            self.kv_waiting[mi].append(idx)
            self.kv_source[idx] = (src.config, src.host)
            self.owner[idx] = None
            return 0
        return self._send(idx, src.config, src.host, dst, t_out)

    def _pick_decoder(self, mi: int, src_host: str) -> _SimReplica | None:
        reps = self.decoders[mi] or [r for r in self.replicas if r.mi == mi and r.config.role is Role.DECODE
                                     and r.state == ReplicaState.DRAINING]
        if not reps:
            return None
        if len(reps) == 1:
            return reps[0]
        # the proxy's rule (planner/kv_route.py): the prefill's host first, within a load bound
        return reps[decode_choices([r.load for r in reps], [r.host for r in reps], src_host)[0]]

    def _send(self, idx: int, src: ConfigKey, src_host: str, dst: _SimReplica, t_out: float) -> int:
        """Move request `idx`'s KV cache from a prefill replica (`src` on `src_host`) to `dst`; it
        joins `dst` when the transfer ends. Returns 1 when `dst` can never hold it (rejected)."""
        try:
            dst.core.check(self.prompt[idx], self.output[idx])
        except RequestTooLongError:
            self.status[idx] = REJECTED
            return 1
        across = src_host != dst.host
        link = self.s.kv_network_link if across else host_link(src.gpu)
        ms = kv_transfer_ms(self._kv_bytes_of(src), float(self.prompt[idx]), link, src.tp)
        self.kv_log.append((idx, ms, across, src_host))
        self.owner[idx] = dst
        self.decode_arrival[idx] = t_out
        dst.load += 1
        dst.inflight.add(idx)

        def join(t: float) -> None:
            if self.status[idx] != PENDING or dst.state == ReplicaState.STOPPED:
                return
            core = dst.core
            assert isinstance(core, DecodeCore)
            core.submit_prefilled(idx, self.prompt[idx], self.output[idx])
            self._begin(dst, t)

        self._push(t_out + ms / 1000.0, self._P_LIFE, "call", join)
        return 0

    def _kv_bytes_of(self, key: ConfigKey) -> float:
        b = self._kv_bytes.get(key)
        if b is None:
            b = kv_bytes_per_token(key)
            if b is None:  # the architecture is unknown: the ground-truth engine's own figure
                p = self.env.params_for(key.profile_key())
                b = p.kv_bytes_per_token_per_gpu * p.tp
            self._kv_bytes[key] = b
        return b

    def _flush(self, mi: int, t: float) -> None:
        """Requests that waited for a decode replica go to the model's decode replicas now."""
        q = self.kv_waiting[mi]
        while q:
            key, host = self.kv_source[q[0]]
            dst = self._pick_decoder(mi, host)
            if dst is None:
                return
            idx = q.popleft()
            del self.kv_source[idx]
            if self.status[idx] == PENDING and self._send(idx, key, host, dst, t):
                self._cut += 1  # rejected: out of the replay's outstanding count
