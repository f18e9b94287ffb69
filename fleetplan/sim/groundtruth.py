"""Ground truth of the simulator: the step-time model of a simulated engine.

The step time comes from the LLM's architecture (fleetplan.models.hardware.llm_spec: parameters, layers,
KV heads, head dim) and the GPU's datasheet (HBM bandwidth, FLOP/s), with per-persona efficiency
factors and seeded noise. It deliberately does NOT use the fitted performance models of models/,
so that fitting a simulated engine's benchmarks tests the fitting honestly.

This module holds the engine parameters (`PersonaFactors`, `EngineParams`, `build_params`) and the
roofline step time (`step_time_s`); the continuous-batching core that steps requests with it is
`fleetplan.sim.batching`, the simulated runs and the ground-truth capacity at an SLO
(`simulate`, `max_rate_at_slo`) are `fleetplan.sim.capacity_truth`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fleetplan.models.hardware import GPU_SPECS, LlmSpec, bytes_per_param, llm_spec
from fleetplan.models.names import Engine, GpuType, Precision

WEIGHT_OVERHEAD = 1.03  # weights + runtime buffers
ACTIVATION_BYTES_PER_GPU = 1.5e9  # activations, CUDA graphs, workspace
NVLINK_BW_BYTES_S = 200e9  # effective all-reduce bandwidth per GPU over NVLink at serving message sizes
PCIE_BW_BYTES_S = 12e9


class RequestTooLongError(ValueError):
    """A request whose prompt + max_tokens can never fit this engine's context or KV pool."""


@dataclass(frozen=True)
class PersonaFactors:
    """How efficiently an engine uses the hardware (fitted once against the TRT-LLM v0.14 table)."""

    mem_eff: float  # fraction of HBM bandwidth reached when streaming weights and KV
    compute_eff: float  # fraction of dense FLOP/s reached by GEMMs (prefill-heavy steps)
    overlap: float  # 0: memory and compute time overlap perfectly (max); 1: they add up
    step_overhead_s: float  # scheduler / launch overhead per step
    tp_layer_latency_s: float  # per all-reduce latency (2 per layer) when tp > 1
    ttft_overhead_s: float  # frontend (HTTP/tokeniser) latency before a request is scheduled
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    kv_fraction_of_free: bool  # True (TRT-LLM): KV = fraction x memory left after weights; False (vLLM):
    # KV = fraction x total memory - weights
    reserve_full_kv: bool  # True: blocks for prompt + max_tokens reserved at admission
    startup_s: float  # load time of a replica (model weights), simulated seconds
    build_s: float  # engine build when no cached engine (trtllm only), simulated seconds


PERSONAS: dict[Engine, PersonaFactors] = {
    Engine.TRTLLM: PersonaFactors(
        mem_eff=0.80,
        compute_eff=0.62,
        overlap=0.35,
        step_overhead_s=0.0012,
        tp_layer_latency_s=25e-6,
        ttft_overhead_s=0.004,
        max_num_seqs=2048,  # trtllm-serve's default max_batch_size
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.90,  # kv_cache_free_gpu_memory_fraction
        kv_fraction_of_free=True,
        reserve_full_kv=True,
        startup_s=60.0,
        build_s=1200.0,
    ),
    Engine.VLLM: PersonaFactors(
        mem_eff=0.76,
        compute_eff=0.55,
        overlap=0.45,
        step_overhead_s=0.0020,
        tp_layer_latency_s=16e-6,
        ttft_overhead_s=0.004,
        max_num_seqs=1024,  # vLLM's API-server defaults on >= 70 GB GPUs (not A100); else 256 / 2048
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.90,
        kv_fraction_of_free=False,
        reserve_full_kv=False,
        startup_s=90.0,
        build_s=0.0,
    ),
}


@dataclass(frozen=True)
class EngineParams:
    persona: Engine
    model: str
    gpu: GpuType
    tp: int
    precision: Precision
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_blocks: int
    block_size: int
    max_model_len: int
    # derived hardware / architecture numbers (per GPU)
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    flops_per_token: float  # dense 2 * params, whole model
    attn_flops_per_ctx_token: float  # 4 * layers * hidden, whole model
    gpu_flops: float  # per GPU, dense, this precision
    hbm_bytes_s: float
    comm_bytes_per_token: float  # all-reduce bytes per token per step (2 per layer)
    link_bytes_s: float
    layers: int
    factors: PersonaFactors
    noise_sigma: float = 0.03
    chunked_prefill: bool = True

    @property
    def reserve_full_kv(self) -> bool:
        return self.factors.reserve_full_kv


def build_params(
    persona: Engine,
    model: str,
    gpu: GpuType,
    tp: int = 1,
    precision: Precision = Precision.BF16,
    *,
    spec: LlmSpec | None = None,
    block_size: int = 16,
    max_model_len: int | None = None,
    noise_sigma: float = 0.03,
    **overrides: object,
) -> EngineParams:
    """EngineParams of `persona` serving `model` on `tp` GPUs of type `gpu`.

    `overrides` replace PersonaFactors fields (e.g. max_num_seqs=64). Raises ValueError naming
    the model when its architecture is unknown and the weights do not fit.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    arch = spec or llm_spec(model)
    if arch is None:
        raise ValueError(f"unknown model {model!r}: no architecture numbers in fleetplan.models.hardware.LLM_SPECS")
    gspec = GPU_SPECS[gpu]
    factors = PERSONAS[persona]
    factor_fields = {k: v for k, v in overrides.items() if hasattr(factors, k)}
    unknown = sorted(set(overrides) - set(factor_fields))
    if unknown:
        raise ValueError(f"unknown engine parameter(s): {', '.join(unknown)}")
    if persona is Engine.VLLM and (gspec.memory_gb < 70 or gpu is GpuType.A100):
        # vLLM's smaller API-server defaults on GPUs under 70 GB and on A100
        factor_fields.setdefault("max_num_seqs", 256)
        factor_fields.setdefault("max_num_batched_tokens", 2048)
    if factor_fields:
        factors = replace(factors, **factor_fields)  # type: ignore[arg-type]
    weight_bytes = arch.weight_bytes(precision)
    kv_per_token = arch.kv_bytes_per_token(precision)
    total = gspec.memory_gb * 1e9 * tp
    resident = weight_bytes * WEIGHT_OVERHEAD + ACTIVATION_BYTES_PER_GPU * tp
    if factors.kv_fraction_of_free:
        free_bytes = (total - resident) * factors.gpu_memory_utilization
    else:
        free_bytes = total * factors.gpu_memory_utilization - resident
    if free_bytes < kv_per_token * block_size * 64:
        raise ValueError(
            f"{model} ({precision.value}) does not fit on {tp} x {gpu.value}: weights and activations "
            f"{resident / 1e9:.0f} GB leave no KV cache room in {total / 1e9:.0f} GB "
            f"(memory fraction {factors.gpu_memory_utilization:g})"
        )
    kv_blocks = int(free_bytes // (kv_per_token * block_size))
    mml = min(131072, kv_blocks * block_size) if max_model_len is None else max_model_len
    return EngineParams(
        persona=persona,
        model=model,
        gpu=gpu,
        tp=tp,
        precision=precision,
        max_num_seqs=factors.max_num_seqs,
        max_num_batched_tokens=factors.max_num_batched_tokens,
        kv_blocks=kv_blocks,
        block_size=block_size,
        max_model_len=mml,
        weight_bytes_per_gpu=weight_bytes / tp,
        kv_bytes_per_token_per_gpu=kv_per_token / tp,
        flops_per_token=2.0 * arch.params_b * 1e9,
        attn_flops_per_ctx_token=4.0 * arch.layers * arch.hidden,
        gpu_flops=gspec.tflops(precision) * 1e12,
        hbm_bytes_s=gspec.hbm_bandwidth_gb_s * 1e9,
        comm_bytes_per_token=2.0 * arch.layers * arch.hidden * min(2.0, bytes_per_param(precision) * 2.0)
        * 2.0 * (tp - 1) / tp,
        link_bytes_s=NVLINK_BW_BYTES_S if gspec.nvlink else PCIE_BW_BYTES_S,
        layers=arch.layers,
        factors=factors,
        noise_sigma=noise_sigma,
    )


def step_time_s(
    params: EngineParams,
    *,
    decode_seqs: int,
    prefill_tokens: int,
    context_tokens: float,
    prefill_attn_pairs: float = 0.0,
) -> float:
    """Noise-free duration of one engine step.

    decode_seqs: sequences decoding one token; prefill_tokens: prompt tokens computed in this step;
    context_tokens: KV tokens read by the decoding sequences; prefill_attn_pairs: query x key pairs
    of the prefill chunks (attention FLOPs of prefill; 0 to ignore).
    """
    tokens = decode_seqs + prefill_tokens
    if tokens <= 0:
        return 0.0
    f = params.factors
    tp = params.tp
    mem_s = (params.weight_bytes_per_gpu + context_tokens * params.kv_bytes_per_token_per_gpu) / (
        params.hbm_bytes_s * f.mem_eff
    )
    flops = tokens * params.flops_per_token + params.attn_flops_per_ctx_token * (
        context_tokens + prefill_attn_pairs
    )
    compute_s = flops / (tp * params.gpu_flops * f.compute_eff)
    hi, lo = (mem_s, compute_s) if mem_s >= compute_s else (compute_s, mem_s)
    t = f.step_overhead_s + hi + f.overlap * lo
    if tp > 1:
        t += 2 * params.layers * f.tp_layer_latency_s + tokens * params.comm_bytes_per_token / params.link_bytes_s
    return t


# -- simulated runs and ground-truth capacity ----------------------------------------------------


StepTime = Callable[[int, int, float, float], float]


def step_time_fn(params: EngineParams) -> StepTime:
    """`step_time_s` of `params` as a function of (decode_seqs, prefill_tokens, context_tokens,
    prefill_attn_pairs): the same float operations in the same order, the engine's constants read
    once (the replay's engines take millions of steps; tests/unit/sim/test_groundtruth.py holds the
    two equal to the last bit)."""
    f = params.factors
    tp = params.tp
    weight = params.weight_bytes_per_gpu
    kv = params.kv_bytes_per_token_per_gpu
    mem_bw = params.hbm_bytes_s * f.mem_eff
    fpt = params.flops_per_token
    attn = params.attn_flops_per_ctx_token
    flops_s = tp * params.gpu_flops * f.compute_eff
    overhead = f.step_overhead_s
    overlap = f.overlap
    tp_latency = 2 * params.layers * f.tp_layer_latency_s
    comm = params.comm_bytes_per_token
    link = params.link_bytes_s

    def step_time(decode_seqs: int, prefill_tokens: int, context_tokens: float, prefill_attn_pairs: float) -> float:
        tokens = decode_seqs + prefill_tokens
        if tokens <= 0:
            return 0.0
        mem_s = (weight + context_tokens * kv) / mem_bw
        compute_s = (tokens * fpt + attn * (context_tokens + prefill_attn_pairs)) / flops_s
        hi, lo = (mem_s, compute_s) if mem_s >= compute_s else (compute_s, mem_s)
        t = overhead + hi + overlap * lo
        if tp > 1:
            t += tp_latency + tokens * comm / link
        return t

    return step_time
