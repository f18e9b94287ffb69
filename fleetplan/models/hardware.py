"""Published hardware and model-architecture numbers.

Used by the roofline prior in models/ (weight bytes / HBM bandwidth per decode step) and, with
its own efficiency factors, by the simulator's ground truth in sim/. Figures are vendor datasheet
values (dense, no sparsity); they are priors, never a substitute for a user's benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from fleetplan.models.names import GpuType, Precision, model_key


@dataclass(frozen=True)
class GpuSpec:
    gpu: GpuType
    memory_gb: float
    hbm_bandwidth_gb_s: float
    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores (A100)
    nvlink: bool
    list_price_usd_h: float  # a rough on-demand price, only a default for examples

    def tflops(self, precision: Precision) -> float:
        if precision in (Precision.FP8, Precision.FP4, Precision.INT8, Precision.INT4) and self.fp8_tflops:
            return self.fp8_tflops
        return self.bf16_tflops


GPU_SPECS: MappingProxyType[GpuType, GpuSpec] = MappingProxyType(
    {
        GpuType.A100: GpuSpec(GpuType.A100, 80.0, 2039.0, 312.0, None, True, 1.8),
        GpuType.L40S: GpuSpec(GpuType.L40S, 48.0, 864.0, 362.0, 733.0, False, 1.1),
        GpuType.H100: GpuSpec(GpuType.H100, 80.0, 3350.0, 989.0, 1979.0, True, 3.0),
        GpuType.H200: GpuSpec(GpuType.H200, 141.0, 4800.0, 989.0, 1979.0, True, 3.8),
        GpuType.GH200: GpuSpec(GpuType.GH200, 96.0, 4000.0, 989.0, 1979.0, True, 4.0),
        GpuType.B200: GpuSpec(GpuType.B200, 180.0, 8000.0, 2250.0, 4500.0, True, 6.0),
        GpuType.GB200: GpuSpec(GpuType.GB200, 186.0, 8000.0, 2500.0, 5000.0, True, 7.0),
        GpuType.RTX4090: GpuSpec(GpuType.RTX4090, 24.0, 1008.0, 165.0, 330.0, False, 0.4),
    }
)


@dataclass(frozen=True)
class LlmSpec:
    """Architecture numbers of an LLM (from its config.json)."""

    name: str
    params_b: float  # parameters read per decode step (active parameters for MoE), billions
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int

    def weight_bytes(self, precision: Precision) -> float:
        return self.params_b * 1e9 * bytes_per_param(precision)

    def kv_bytes_per_token(self, precision: Precision) -> float:
        # K and V, every layer; KV cache kept in 16 bit unless the weights are FP8/lower
        kv_elem = 1.0 if precision in (Precision.FP8, Precision.FP4, Precision.INT4) else 2.0
        return 2.0 * self.layers * self.kv_heads * self.head_dim * kv_elem


def bytes_per_param(precision: Precision) -> float:
    return {
        Precision.BF16: 2.0,
        Precision.FP16: 2.0,
        Precision.FP8: 1.0,
        Precision.INT8: 1.0,
        Precision.FP4: 0.5,
        Precision.INT4: 0.5,
    }[precision]


_LLAMA_8B = LlmSpec("llama-3.1-8b", 8.03, 32, 4096, 8, 128)
_LLAMA_70B = LlmSpec("llama-3.1-70b", 70.6, 80, 8192, 8, 128)
_LLAMA_405B = LlmSpec("llama-3.1-405b", 405.9, 126, 16384, 8, 128)

# Keys are model_key() of the spellings; several spellings share one architecture.
LLM_SPECS: MappingProxyType[str, LlmSpec] = MappingProxyType(
    {
        model_key(name): spec
        for names, spec in (
            (("llama-3.1-8b", "llama-3-8b", "llama 3.1 8b", "llama v3.1 8b", "llama-3.1-8b-instruct",
              "llama-3-8b-instruct", "meta-llama-3-8b", "meta-llama-3.1-8b-instruct"), _LLAMA_8B),
            (("llama-3.1-70b", "llama-3-70b", "llama 3.1 70b", "llama v3.1 70b", "llama-3.1-70b-instruct",
              "llama-3-70b-instruct", "llama-3.3-70b", "llama-3.3-70b-instruct", "llama v3.3 70b"), _LLAMA_70B),
            (("llama-3.1-405b", "llama v3.1 405b", "llama-3.1-405b-instruct"), _LLAMA_405B),
        )
        for name in names
    }
)


def llm_spec(model: str) -> LlmSpec | None:
    """The architecture of `model` when known, else None (unknown: the roofline prior is skipped)."""
    return LLM_SPECS.get(model_key(model))
