"""Policies the replay's unit tests share."""

# one host of 8 H100, llama-3-8b on vLLM TP1 only
ONE_HOST_8B = """
version: 1
gpu_types: {h100: {price_usd_h: 2.0}}
hosts: [{name: h1, gpu: h100, gpu_count: 8}]
engines:
  vllm: {launch: {command: vllm}, startup: {default_s: 30}}
scaling: {cycle_s: 60, scale_down_delay_s: 120}
models:
  - {name: llama-3-8b, slo: {ttft_p99_ms: 500, itl_p99_ms: 50}, allowed: {engines: [vllm], tp: [1]},
     workload: {isl: 500, osl: 50}, headroom: 0.1}
"""


def two_hosts_8b_pools(allowed: bool, *, ttft_ms: float, itl_ms: float, startup_s: int, cycle_s: int,
                       scale_down_delay_s: int, headroom: float, isl: int, osl: int) -> str:
    """Two hosts of 8 H100, llama-3-8b on vLLM TP1 only, disaggregated pools `allowed` or not."""
    return f"""
version: 1
gpu_types: {{h100: {{price_usd_h: 2.0}}}}
hosts: [{{name: h1, gpu: h100, gpu_count: 8}}, {{name: h2, gpu: h100, gpu_count: 8}}]
engines:
  vllm: {{launch: {{command: vllm}}, startup: {{default_s: {startup_s}}}}}
scaling: {{cycle_s: {cycle_s}, scale_down_delay_s: {scale_down_delay_s}}}
models:
  - {{name: llama-3-8b, slo: {{ttft_p99_ms: {ttft_ms:g}, itl_p99_ms: {itl_ms:g}}}, allowed: {{engines: [vllm], tp: [1]}},
     workload: {{isl: {isl}, osl: {osl}}}, headroom: {headroom:g}, disaggregation: {{allowed: {str(allowed).lower()}}}}}
"""
