"""Disaggregated prefill and decode: one replica's capacity in a prefill pool and in a decode pool.

In aggregated serving one engine runs both phases: a prompt's prefill shares the GPU with the other
requests' decode steps, so the step time, hence every running request's ITL, rises with the prefill
work (`models.profile`: ITL = s0 / (1 - rho) with rho counting the prefill work, plus the prefill
stalls of the p99 request where the profile has them). Disaggregated serving (vLLM's
`--kv-transfer-config` with a KV connector, TensorRT-LLM's `trtllm-serve disaggregated`) runs the
prompts on prefill instances, moves their KV cache to decode instances, and decodes there with no
prefill in any step. The cost is the KV transfer, the second hop, and two pools to size.

Both pools are read off the aggregated profile's own equations (nothing here is a second copy of
them):

- **Prefill pool**: the aggregated profile on the mix with every output one token long (a prefill
  instance returns after the first token): rho = x E[P], the queue behind the prompts ahead
  (`models.mix`), each prompt's own prefill and chunk steps, and beyond the GPU work the KV
  transfer of the class's prompt plus the decode side's join (its front end and one decode step):

      TTFT_i = profile TTFT_i(osl = 1) + h + kv_bytes * isl_i / (t * eff * link) + d0 + s_d

  with t the TP size (each GPU of the group moves its shard on its own link), eff the achievable
  share of the link's line rate, h the link's per-transfer latency, d0 the engine's front-end
  latency (`ttft_fixed_ms`) and s_d the decode step at the ITL target (target / k99).
- **Decode pool**: the aggregated profile with no prefill work (p0 = p1 = p2 = 0, no prefill stalls):
  the step time is s0 / (1 - x E[(s1 + s2 (isl + osl/2)) (osl - 1)]) (as `closed_loop_shift`'s
  decode-only step), the per-request ITL p99 its k99 multiple, and the batch bounded by the KV
  cache (`kv_tokens` / (isl + osl) sequences).

KV bytes per token come from the model's architecture (`hardware.LlmSpec.kv_bytes_per_token`:
2 x layers x KV heads x head dim x bytes per element). The link is NVLink (or PCIe) inside a host
and the network between hosts; the figures below are line rates per GPU and direction.

**Extrapolated.** Engines export nothing that separates the phases in a benchmark of a
disaggregated deployment: `vllm bench serve` against vLLM's proxy writes the same JSON as against
one engine (TTFT, TPOT, ITL percentiles, request throughput), and TensorRT-LLM's disaggregated
studies report throughput per GPU at a TPOT target for a given context:generation server count.
A prefill pool alone can be benchmarked as an ordinary engine with one output token; a decode pool
cannot. So the pools are derived from the aggregated profile and flagged `extrapolated`; pool
profiles fitted elsewhere (a prefill profile from osl = 1 runs) enter through `PoolProfiles` with
`extrapolated=False`. Online, both pools are corrected like every profile (their TTFT and ITL speeds).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from types import MappingProxyType

from fleetplan.models.hardware import llm_spec
from fleetplan.models.kv_room import kv_room_rps
from fleetplan.models.mix import SLO_SHARE, LengthMix, MixCapacity, capacity_mix
from fleetplan.models.names import GpuType
from fleetplan.models.profile import ConfigKey, PerfProfile


class LinkKind(StrEnum):
    NVLINK = "nvlink"  # inside a host: NVLink / NVSwitch
    PCIE = "pcie"  # inside a host without NVLink (peer to peer over PCIe)
    NETWORK = "network"  # between hosts: RDMA over InfiniBand or RoCE


@dataclass(frozen=True)
class KvLink:
    """The path a KV cache takes from a prefill GPU to a decode GPU."""

    kind: LinkKind
    gb_s: float  # line rate per GPU and direction (GB/s, 1e9 bytes)
    latency_ms: float  # per transfer: connector handshake, completion notice, first bytes

    def __post_init__(self) -> None:
        if not (self.gb_s > 0 and math.isfinite(self.gb_s)):
            raise ValueError(f"KvLink.gb_s must be a positive number, got {self.gb_s!r}")
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise ValueError(f"KvLink.latency_ms must be >= 0, got {self.latency_ms!r}")


# Achievable share of a link's line rate for large transfers (NCCL/perftest bus bandwidth on NVLink
# and InfiniBand reaches ~80-90% of line rate; KV blocks are moved in pages, not one buffer): a prior.
LINK_EFFICIENCY = 0.8

# Line rates. NVLink: NVIDIA's datasheets give the total of both directions per GPU (A100 600 GB/s,
# H100/H200 900 GB/s, B200 1.8 TB/s); one direction is half. PCIe Gen4 x16: 32 GB/s per direction.
# Network: DGX H100 has one ConnectX-7 400 Gb/s port per GPU (NDR InfiniBand: 50 GB/s); 100 GbE
# (12.5 GB/s) and 25 GbE (3.125 GB/s) are common cloud and on-premise Ethernet NICs. The per-transfer
# latencies are priors (RDMA itself takes microseconds; the connector's metadata and completion
# round trips take longer across hosts).
NVLINK3 = KvLink(LinkKind.NVLINK, 300.0, 0.1)
NVLINK4 = KvLink(LinkKind.NVLINK, 450.0, 0.1)
NVLINK5 = KvLink(LinkKind.NVLINK, 900.0, 0.1)
PCIE4 = KvLink(LinkKind.PCIE, 32.0, 0.1)
IB_NDR_400G = KvLink(LinkKind.NETWORK, 50.0, 0.5)
ETH_100G = KvLink(LinkKind.NETWORK, 12.5, 0.5)
ETH_25G = KvLink(LinkKind.NETWORK, 3.125, 0.5)

_HOST_LINKS: Mapping[GpuType, KvLink] = MappingProxyType({
    GpuType.A100: NVLINK3, GpuType.H100: NVLINK4, GpuType.H200: NVLINK4, GpuType.GH200: NVLINK4,
    GpuType.B200: NVLINK5, GpuType.GB200: NVLINK5, GpuType.L40S: PCIE4, GpuType.RTX4090: PCIE4,
})


def host_link(gpu: GpuType) -> KvLink:
    """The link between two GPUs of one host: NVLink of the GPU's generation, else PCIe.

    >>> host_link(GpuType.H100).gb_s, host_link(GpuType.L40S).kind.value
    (450.0, 'pcie')
    """
    return _HOST_LINKS.get(gpu, PCIE4)


def kv_bytes_per_token(key: ConfigKey) -> float | None:
    """KV-cache bytes one token of `key`'s model holds (all layers, K and V; None: architecture unknown).

    >>> from fleetplan.models.names import Engine, Precision
    >>> kv_bytes_per_token(ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16))
    131072.0
    """
    spec = llm_spec(key.model)
    return None if spec is None else spec.kv_bytes_per_token(key.precision)


def kv_transfer_ms(bytes_per_token: float, tokens: float, link: KvLink, tp: int = 1) -> float:
    """Time to move the KV cache of `tokens` prompt tokens over `link` from a TP-`tp` prefill replica
    (each GPU sends its shard on its own link): latency + bytes / (tp x efficiency x line rate).

    >>> round(kv_transfer_ms(131072.0, 2048, IB_NDR_400G), 2)   # Llama-3-8B, 2,048 tokens, 400 Gb/s
    7.21
    >>> round(kv_transfer_ms(131072.0, 2048, NVLINK4), 2)
    0.85
    """
    rate = max(tp, 1) * LINK_EFFICIENCY * link.gb_s * 1e9  # bytes/s
    return link.latency_ms + bytes_per_token * max(tokens, 0.0) / rate * 1000.0


@dataclass(frozen=True)
class PoolProfiles:
    """The profiles a prefill replica and a decode replica follow (one engine, GPU type and TP)."""

    prefill: PerfProfile  # evaluated on the mix with one output token per request
    decode: PerfProfile  # evaluated on the mix with no prefill work
    extrapolated: bool  # True: derived from an aggregated profile, no disaggregated benchmark behind it


def pool_profiles(aggregated: PerfProfile) -> PoolProfiles:
    """Both pools' profiles from an aggregated one: the prefill pool runs it as it is (on prompts
    alone), the decode pool without the prefill terms and without prefill stalls."""
    p = aggregated.params
    decode = replace(aggregated, params=replace(p, p0_ms=0.0, p1_ms=0.0, p2_ms=0.0, itl_stall_weight=0.0),
                     notes=(*aggregated.notes, "decode pool: the aggregated profile without prefill work"))
    return PoolProfiles(prefill=aggregated, decode=decode, extrapolated=True)


def prefill_mix(mix: LengthMix) -> LengthMix:
    """The mix a prefill replica serves: the same prompts, one output token each."""
    return replace(mix, classes=tuple((isl, 1.0, w) for isl, _, w in mix.classes))


@dataclass(frozen=True)
class DisaggCapacity:
    """One prefill replica's and one decode replica's largest rate at the SLO, for a mix."""

    prefill: MixCapacity  # binding "ttft": TTFT p99 (queue + prefill + transfer + join) at the target
    decode: MixCapacity  # binding "itl" or "memory": decode-only ITL p99 or the KV cache
    transfer_p99_ms: float  # KV transfer of the mix's p99 prompt
    join_ms: float  # the decode side's front end and first step, in every TTFT
    link: KvLink
    tp: int
    extrapolated: bool  # from the aggregated profile's physics (PoolProfiles.extrapolated)

    def pool_counts(self, rate_rps: float, headroom: float = 0.0) -> tuple[int, int]:
        """(prefill replicas, decode replicas) for `rate_rps` with capacity >= rate x (1 + headroom);
        (0, 0) at no load; a pool that cannot meet its target at any load needs no finite count
        (ValueError).

        >>> cap = DisaggCapacity(MixCapacity(10.0, "ttft"), MixCapacity(60.0, "itl"), 5.0, 20.0, NVLINK4, 1, True)
        >>> cap.pool_counts(25.0), cap.pool_counts(25.0, headroom=0.2), cap.pool_counts(0.0)
        ((3, 1), (3, 1), (0, 0))
        """
        need = max(rate_rps, 0.0) * (1.0 + headroom)
        if need <= 0.0:
            return 0, 0
        return replicas_for(need, self.prefill.max_rps), replicas_for(need, self.decode.max_rps)


def replicas_for(need_rps: float, per_replica_rps: float) -> int:
    """Replicas of `per_replica_rps` each that carry `need_rps` (at least one when there is load)."""
    if need_rps <= 0.0:
        return 0
    if not per_replica_rps > 0.0:
        raise ValueError(f"per_replica_rps={per_replica_rps}: a replica that serves nothing at the SLO")
    if math.isinf(per_replica_rps):
        return 1
    return max(1, math.ceil(need_rps / per_replica_rps - 1e-9))


def disagg_capacity(pools: PoolProfiles, mix: LengthMix, *, ttft_p99_ms: float, itl_p99_ms: float,
                    link: KvLink, kv_bytes: float | None = None, prefill_speed: float = 1.0,
                    decode_speed: float = 1.0, transfer_isl_p99: float | None = None) -> DisaggCapacity | None:
    """One prefill replica's and one decode replica's capacity for `mix` at the SLO over `link`
    (None: the KV bytes per token are unknown: neither given nor in the model's architecture).
    `prefill_speed` / `decode_speed`: each pool's engine speed relative to its profile (the online
    correction's TTFT speed of the prefill pool and ITL speed of the decode pool; `models.mix.scaled`).
    `transfer_isl_p99`: the prompt-length p99 when `mix` stands for a wider distribution (a profile
    fitted on a length spread is evaluated at the mean lengths): every class's TTFT then carries at
    least that prompt's transfer, whose tail the mean would miss (None: each class its own prompt's).

    >>> from fleetplan.models.names import Engine, Precision
    >>> from fleetplan.models.profile import roofline_profile
    >>> prof = roofline_profile(ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16))
    >>> mix = LengthMix(((1024.0, 16.0, 0.5), (4096.0, 48.0, 0.5)))
    >>> cap = disagg_capacity(pool_profiles(prof), mix, ttft_p99_ms=500.0, itl_p99_ms=50.0, link=NVLINK4)
    >>> round(cap.prefill.max_rps, 2), cap.prefill.binding, round(cap.decode.max_rps), cap.decode.binding
    (5.95, 'ttft', 98, 'memory')
    >>> round(cap.transfer_p99_ms, 2), round(cap.join_ms, 1), cap.extrapolated
    (1.59, 29.8, True)
    """
    key = pools.prefill.key
    per_token = kv_bytes if kv_bytes is not None else kv_bytes_per_token(key)
    if per_token is None:
        return None
    d = pools.decode.params
    join = d.ttft_fixed_ms + itl_p99_ms / d.itl_p99_factor  # the decode step at the ITL target (mean)
    floor = 0.0 if transfer_isl_p99 is None else transfer_isl_p99
    added = [kv_transfer_ms(per_token, max(isl, floor), link, key.tp) + join for isl, _, _ in mix.classes]
    prefill = capacity_mix(pools.prefill, prefill_mix(mix), ttft_p99_ms=ttft_p99_ms, itl_p99_ms=math.inf,
                           ttft_speed=prefill_speed, ttft_added_ms=added)
    if max(o for _, o, _ in mix.classes) <= 1.0:
        decode = MixCapacity(math.inf, "itl")  # one output token each: nothing to decode
    else:
        decode = capacity_mix(pools.decode, mix, ttft_p99_ms=math.inf, itl_p99_ms=itl_p99_ms,
                              itl_speed=decode_speed)
        room = kv_room_rps(pools.decode, mix, wait_share=1.0 - SLO_SHARE, speed=decode_speed)
        if room < decode.max_rps:  # arrivals beyond the p99 one would wait for KV room, in their TTFT
            decode = MixCapacity(room, "memory", decode.floor_share)
    p99 = max(mix.isl_quantile(0.99), floor)
    return DisaggCapacity(prefill, decode, kv_transfer_ms(per_token, p99, link, key.tp),
                          join, link, key.tp, pools.extrapolated)
