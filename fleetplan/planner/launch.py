"""Launch templates: the command line the agent runs for a replica (pure string formatting).

Placeholders in `engines.<engine>.launch.command/args/env` of the policy:
{model} canonical name, {hf_model} the first alias containing '/' (a Hugging Face id) or the name,
{tp}, {port}, {gpu_indices} (comma-separated, for CUDA_VISIBLE_DEVICES), {precision}, {gpu},
{engine_dir} (the engine's `engine_dir` template, itself formatted with the same fields),
{replica_id}, {host}. The agent executes only its own allowlisted templates (config/agent*.yaml);
these policy templates document the command line and serve tools that need it; the controller
names the agent template with `Policy.agent_templates()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fleetplan.planner.policy import Policy, PolicyError
from fleetplan.planner.types import ConfigKey


@dataclass(frozen=True)
class LaunchCommand:
    command: str
    args: tuple[str, ...]
    env: Mapping[str, str]


def launch_fields(policy: Policy, config: ConfigKey, port: int | None, gpu_indices: tuple[int, ...],
                  replica_id: str = "", host: str = "") -> dict[str, str]:
    m = policy.model(config.model)
    hf = next((a for a in (m.aliases if m else ()) if "/" in a), config.model)
    fields = {
        "model": config.model, "hf_model": hf, "tp": str(config.tp), "port": "" if port is None else str(port),
        "gpu_indices": ",".join(str(i) for i in gpu_indices), "precision": config.precision.value,
        "gpu": config.gpu.value, "engine": config.engine.value, "replica_id": replica_id, "host": host,
    }
    e = policy.engines.get(config.engine)
    fields["engine_dir"] = e.engine_dir.format(**fields) if e is not None else ""
    return fields


def render_launch(policy: Policy, config: ConfigKey, port: int | None, gpu_indices: tuple[int, ...],
                  replica_id: str = "", host: str = "") -> LaunchCommand:
    """The command, args and env for one replica. Raises PolicyError on an unknown placeholder."""
    e = policy.engines.get(config.engine)
    if e is None:
        raise PolicyError("policy", [f"engines.{config.engine.value}: not configured"])
    f = launch_fields(policy, config, port, gpu_indices, replica_id, host)
    try:
        return LaunchCommand(e.launch.command.format(**f), tuple(a.format(**f) for a in e.launch.args),
                             {k: v.format(**f) for k, v in e.launch.env.items()})
    except (KeyError, IndexError, ValueError) as exc:
        raise PolicyError("policy", [f"engines.{config.engine.value}.launch: bad placeholder {exc}"]) from None
