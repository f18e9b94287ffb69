"""The simulated engine as one instance of a disaggregated deployment: a prefill or a decode instance.

vLLM's disaggregated serving (a KV connector such as NixlConnector, `--kv-transfer-config` with
`"kv_role": "kv_both"`) runs two kinds of instance behind a proxy. The proxy sends the client's
request to a prefill instance with `max_tokens` 1, streaming off, and `kv_transfer_params`
`{"do_remote_decode": true, ...}`; the prefill instance computes the prompt, answers one token and
returns in its response `kv_transfer_params` naming where the KV blocks wait
(`remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, `do_remote_prefill`: true).
The proxy then sends the client's request to a decode instance with those parameters; the decode
instance pulls the blocks and decodes, streaming to the client.

The simulation: a prefill instance (`--role prefill`) answers every request with one token and
those parameters. A decode instance (`--role decode`) given parameters with `do_remote_prefill`
skips the prompt's compute (`BatchCore.submit(prefilled=True)`) after the KV transfer time of the
prompt (`fleetplan.models.disagg.kv_transfer_ms` over the GPU's in-host link); a request without
them it serves whole, as vLLM's `kv_both` instances do. Both count what they served in the same
metric series as an aggregated engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetplan.models.config_key import Role
from fleetplan.models.disagg import host_link, kv_transfer_ms
from fleetplan.sim.engine_config import EngineConfig
from fleetplan.sim.engine_requests import RequestError
from fleetplan.sim.groundtruth import EngineParams

__all__ = ["KvParams", "PrefillTickets", "kv_params_of", "transfer_s"]


@dataclass(frozen=True)
class KvParams:
    """What a request's `kv_transfer_params` ask of this instance."""

    remote_decode: bool  # a prefill leg: compute the prompt, keep its KV for a decode instance
    remote_prefill: bool  # a decode leg: the prompt's KV comes from a prefill instance


def kv_params_of(body: dict[str, Any]) -> KvParams | None:
    """The request's `kv_transfer_params` (None: absent or null). RequestError (400) when malformed."""
    raw = body.get("kv_transfer_params")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(400, f"kv_transfer_params must be an object, got {type(raw).__name__}")
    return KvParams(remote_decode=bool(raw.get("do_remote_decode")),
                    remote_prefill=bool(raw.get("do_remote_prefill")))


def transfer_s(cfg: EngineConfig, params: EngineParams, prompt_tokens: int) -> float:
    """Simulated seconds the prompt's KV takes from a prefill instance of the same GPU type and TP
    (the in-host link of the GPU type: NVLink, else PCIe)."""
    per_token = params.kv_bytes_per_token_per_gpu * params.tp
    return kv_transfer_ms(per_token, float(prompt_tokens), host_link(cfg.gpu), cfg.tp) / 1000.0


class PrefillTickets:
    """The `kv_transfer_params` a prefill instance returns: where a decode instance finds the KV
    blocks of each request (block ids are numbered per instance, as a KV cache's are)."""

    def __init__(self, engine_id: str, host: str, port: int, tp: int, block_size: int) -> None:
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.tp = tp
        self.block_size = block_size
        self._next_block = 0

    def issue(self, prompt_tokens: int) -> dict[str, Any]:
        blocks = -(-max(prompt_tokens, 1) // self.block_size)
        first = self._next_block
        self._next_block += blocks
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(range(first, first + blocks)),
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp,
        }


def serves_one_token(role: Role) -> bool:
    """A prefill instance answers one token whatever max_tokens the request names."""
    return role is Role.PREFILL
