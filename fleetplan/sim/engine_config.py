"""The simulated engine's configuration: its persona, model, GPU and the simulation's knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fleetplan.models.config_key import Role
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.sim.groundtruth import EngineParams, build_params


@dataclass(frozen=True)
class EngineConfig:
    persona: Engine
    model: str  # served model name (also selects the architecture)
    gpu: GpuType
    tp: int = 1
    precision: Precision = Precision.BF16
    time_scale: float = 1.0
    startup_s: float | None = None  # simulated; None: the persona's default (+ build if not cached)
    engine_cached: bool = True  # trtllm: a built engine exists (no build at startup)
    replica_id: str | None = None
    seed: int = 0
    min_chunk_interval_ms: float = 0.0  # wall
    natural_mean_tokens: float = 180.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    noise_sigma: float = 0.03
    lag_tolerance_s: float = math.inf  # wall; beyond it a lagging clock jumps forward (inf: never)
    drain_timeout_s: float = 600.0  # wall
    prefix_caching: bool = True  # vLLM's automatic prefix caching / TensorRT-LLM's KV cache reuse (both default on)
    role: Role = Role.AGGREGATED  # a prefill or decode instance of a disaggregated deployment (sim.engine_roles)

    def params(self) -> EngineParams:
        overrides: dict[str, Any] = {}
        if self.max_num_seqs is not None:
            overrides["max_num_seqs"] = self.max_num_seqs
        if self.max_num_batched_tokens is not None:
            overrides["max_num_batched_tokens"] = self.max_num_batched_tokens
        return build_params(
            self.persona, self.model, self.gpu, self.tp, self.precision, noise_sigma=self.noise_sigma, **overrides
        )

    def startup_sim_s(self, params: EngineParams) -> float:
        if self.startup_s is not None:
            return max(0.0, self.startup_s)
        size = max(1.0, params.weight_bytes_per_gpu * params.tp / 16e9)  # relative to an 8B BF16 model
        load = params.factors.startup_s * (0.5 + 0.5 * math.sqrt(size) / 3.0)
        build = 0.0
        if self.persona is Engine.TRTLLM and not self.engine_cached:
            build = params.factors.build_s * (0.75 + 0.25 * math.sqrt(size))
        return load + build
