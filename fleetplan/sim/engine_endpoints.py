"""The simulated engine's clock and what it reports: health, version, models, its metrics (vLLM's
Prometheus text; TensorRT-LLM's Prometheus text and JSON iteration stats) and `/sim/state`.

A mixin of `fleetplan.sim.engine.SimEngine`, which sets the state declared here; the request
handlers and the step loop stay in the engine."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from fleetplan.sim.batching import BatchCore
from fleetplan.sim.engine_config import EngineConfig
from fleetplan.sim.groundtruth import EngineParams


class EngineEndpoints:
    """The engine's simulated clock and its status and metrics endpoints (set by `SimEngine.__init__`)."""

    cfg: EngineConfig
    params: EngineParams
    core: BatchCore
    incoming: deque[Any]
    startup_sim_s: float
    draining: bool
    lag_events: int
    lag_sim_s: float
    behind_max_wall_s: float
    steps: int
    last_step_s: float
    vllm_registry: CollectorRegistry
    trtllm_registry: CollectorRegistry
    _t0_wall: float
    _sim_t: float

    # -- clock ---------------------------------------------------------------------------------
    def wall_sim_now(self) -> float:
        return (time.monotonic() - self._t0_wall) * self.cfg.time_scale

    def sim_now(self) -> float:
        return max(self._sim_t, self.wall_sim_now()) if self.core.idle() else self._sim_t

    @property
    def ready(self) -> bool:
        return self.wall_sim_now() >= self.startup_sim_s

    # -- handlers ------------------------------------------------------------------------------
    async def h_health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.Response(status=503, text="draining")
        if not self.ready:
            return web.Response(status=503, text="starting")
        return web.Response(status=200)

    async def h_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fleetplan-sim", "persona": self.cfg.persona.value})

    async def h_models(self, request: web.Request) -> web.Response:
        return web.json_response({
            "object": "list",
            "data": [{"id": self.cfg.model, "object": "model", "created": int(time.time()), "owned_by": "fleetplan-sim",
                      "root": self.cfg.model, "parent": None, "max_model_len": self.params.max_model_len}],
        })

    async def h_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.vllm_registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def h_trt_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.trtllm_registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def h_trt_iteration_stats(self, request: web.Request) -> web.Response:
        """trtllm-serve's `/metrics`: JSON iteration stats, not Prometheus text (the keys the
        MetricsCollector reads from them; NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py
        `log_iteration_stats`)."""
        core, p = self.core, self.params
        used = round(core.kv_usage * p.kv_blocks)
        return web.json_response([{
            "iter": self.steps,
            "iterLatencyMS": self.last_step_s * 1000.0,
            "numActiveRequests": core.num_running,
            "numQueuedRequests": core.num_waiting + len(self.incoming),
            "maxNumActiveRequests": p.max_num_seqs,
            "kvCacheStats": {"maxNumBlocks": p.kv_blocks, "usedNumBlocks": used, "freeNumBlocks": p.kv_blocks - used,
                             "tokensPerBlock": p.block_size},
        }])

    async def h_state(self, request: web.Request) -> web.Response:
        return web.json_response({
            "persona": self.cfg.persona.value, "model": self.cfg.model, "replica_id": self.cfg.replica_id,
            "gpu": self.cfg.gpu.value, "tp": self.cfg.tp, "precision": self.cfg.precision.value,
            "sim_time_s": self.sim_now(), "time_scale": self.cfg.time_scale, "ready": self.ready,
            "draining": self.draining, "startup_s": self.startup_sim_s, "running": self.core.num_running,
            "waiting": self.core.num_waiting + len(self.incoming), "kv_usage": self.core.kv_usage,
            "kv_blocks": self.params.kv_blocks, "max_num_seqs": self.params.max_num_seqs,
            "steps": self.steps, "lag_events": self.lag_events, "lag_sim_s": self.lag_sim_s,
            "behind_max_wall_s": self.behind_max_wall_s,
        })
