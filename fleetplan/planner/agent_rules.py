"""What a host agent accepts: the rules a desired state is checked against. Pure.

The real agent (controller/agent.py, through controller/protocol.py `check_desired` and
`desired_conflicts`) and the replay's simulated agents (sim/des_world.py) both call these, so a
desired state the replay's agents run is one a real agent runs too.

- `conflicts`: ids, ports and GPUs used twice inside one desired state;
- `refusals`: what this host cannot run (`AgentLimits`: GPU type and count, port range, the
  agent's launch and build templates, its model allowlist, the engines it holds).

Each error is one line naming the replica or build, the field and the value.

>>> from fleetplan.models.names import Engine, GpuType, Precision
>>> c = ConfigKey("m", Engine.VLLM, GpuType.H100, 2, Precision.BF16)
>>> limits = AgentLimits("h1", GpuType.H100, 8, (8000, 8099), {"vllm": Engine.VLLM})
>>> refusals([WantedReplica("r1", "vllm", c, (0, 1), 8000)], [], limits)
[]
>>> for e in refusals([WantedReplica("r1", "vllm", c, (7, 8), 9000)], [], limits):
...     print(e)
replica r1: port 9000 outside this host's range 8000-8099
replica r1: GPU index 8 out of range (host h1 has 8 GPUs: 0-7)
>>> conflicts([WantedReplica("r1", "vllm", c, (0, 1), 8000), WantedReplica("r2", "vllm", c, (1, 2), 8000)], [])
['port 8000 used by both r1 and r2', 'GPU 1 used by both r1 and r2']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fleetplan.models.names import Engine, GpuType
from fleetplan.models.profile import ConfigKey

__all__ = ["AgentLimits", "WantedBuild", "WantedReplica", "conflicts", "refusals"]


@dataclass(frozen=True)
class AgentLimits:
    """The facts about one host a desired state is checked against."""

    host: str
    gpu: GpuType
    gpu_count: int
    port_range: tuple[int, int]  # inclusive
    launch_templates: Mapping[str, Engine]  # template name -> engine it starts
    build_templates: frozenset[str] = frozenset()
    models: frozenset[str] | None = None  # None: any model name
    engine_templates_need_cache: frozenset[str] = frozenset()  # templates that run a built engine
    engines_cached: frozenset[ConfigKey] = field(default_factory=frozenset)  # built engines it holds


@dataclass(frozen=True)
class WantedReplica:
    """A replica in a host's desired state."""

    replica_id: str
    template: str
    config: ConfigKey
    gpu_indices: tuple[int, ...]
    port: int


@dataclass(frozen=True)
class WantedBuild:
    """An engine build in a host's desired state."""

    build_id: str
    template: str
    config: ConfigKey
    gpu_indices: tuple[int, ...]


def conflicts(replicas: Sequence[WantedReplica], builds: Sequence[WantedBuild]) -> list[str]:
    """Ids, ports and GPUs used twice inside one desired state."""
    errors: list[str] = []
    ids: set[str] = set()
    for item_id in [r.replica_id for r in replicas] + [b.build_id for b in builds]:
        if item_id in ids:
            errors.append(f"id {item_id!r} appears twice")
        ids.add(item_id)
    ports: dict[int, str] = {}
    for r in replicas:
        if r.port in ports:
            errors.append(f"port {r.port} used by both {ports[r.port]} and {r.replica_id}")
        ports[r.port] = r.replica_id
    gpus: dict[int, str] = {}
    owners: Iterable[tuple[str, tuple[int, ...]]] = [(r.replica_id, r.gpu_indices) for r in replicas] + [
        (b.build_id, b.gpu_indices) for b in builds]
    for owner, indices in owners:
        for g in indices:
            if g in gpus and gpus[g] != owner:
                errors.append(f"GPU {g} used by both {gpus[g]} and {owner}")
            gpus[g] = owner
    return errors


def refusals(replicas: Sequence[WantedReplica], builds: Sequence[WantedBuild], limits: AgentLimits) -> list[str]:
    """Errors (one line each) for everything this host cannot run; empty when all is fine. A replica
    of a template that runs a built engine needs that engine cached on the host or built by one of
    `builds`.

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> c = ConfigKey("m", Engine.TRTLLM, GpuType.H100, 1, Precision.FP8)
    >>> limits = AgentLimits("h1", GpuType.H100, 8, (8000, 8099), {"trt": Engine.TRTLLM},
    ...                      build_templates=frozenset({"trt-build"}),
    ...                      engine_templates_need_cache=frozenset({"trt"}))
    >>> refusals([WantedReplica("r1", "trt", c, (0,), 8000)], [], limits)
    ["replica r1: template 'trt' needs a built engine for m/h100/tp1/fp8; none cached, build it first"]
    >>> refusals([WantedReplica("r1", "trt", c, (0,), 8000)], [WantedBuild("b1", "trt-build", c, (1,))], limits)
    []

    A disaggregated model's pool replica runs the same built engine (`ConfigKey.profile_key`):

    >>> from dataclasses import replace
    >>> from fleetplan.models.config_key import Role
    >>> pools = replace(limits, launch_templates={"trt-decode": Engine.TRTLLM}, engines_cached=frozenset({c}),
    ...                 engine_templates_need_cache=frozenset({"trt-decode"}))
    >>> refusals([WantedReplica("r2", "trt-decode", replace(c, role=Role.DECODE), (0,), 8001)], [], pools)
    []
    """
    errors: list[str] = []
    lo, hi = limits.port_range
    building = {b.config for b in builds}
    for r in replicas:
        where = f"replica {r.replica_id}"
        c = r.config
        if r.template not in limits.launch_templates:
            known = ", ".join(sorted(limits.launch_templates)) or "none"
            errors.append(f"{where}: unknown template {r.template!r} (this host has: {known})")
        elif limits.launch_templates[r.template] != c.engine:
            errors.append(
                f"{where}: template {r.template!r} starts {limits.launch_templates[r.template].value}, "
                f"not engine {c.engine.value!r}"
            )
        elif r.template in limits.engine_templates_need_cache:
            engine = c.profile_key()  # a pool's replica runs the same built engine as an aggregated one
            if engine not in limits.engines_cached and engine not in building:
                errors.append(
                    f"{where}: template {r.template!r} needs a built engine for "
                    f"{c.model}/{c.gpu.value}/tp{c.tp}/{c.precision.value}; none cached, build it first"
                )
        if not lo <= r.port <= hi:
            errors.append(f"{where}: port {r.port} outside this host's range {lo}-{hi}")
        errors += _common(where, c, r.gpu_indices, limits)
    for b in builds:
        where = f"build {b.build_id}"
        if b.template not in limits.build_templates:
            known = ", ".join(sorted(limits.build_templates)) or "none"
            errors.append(f"{where}: unknown build template {b.template!r} (this host has: {known})")
        errors += _common(where, b.config, b.gpu_indices, limits)
    return errors


def _common(where: str, config: ConfigKey, indices: Sequence[int], limits: AgentLimits) -> list[str]:
    errors: list[str] = []
    if config.gpu != limits.gpu:
        errors.append(f"{where}: gpu {config.gpu.value!r} but host {limits.host} has {limits.gpu.value}")
    bad = [g for g in indices if g >= limits.gpu_count]
    if bad:
        errors.append(
            f"{where}: GPU index {bad[0]} out of range (host {limits.host} has {limits.gpu_count} GPUs: "
            f"0-{limits.gpu_count - 1})"
        )
    if limits.models is not None and config.model not in limits.models:
        errors.append(f"{where}: model {config.model!r} is not in this host's model allowlist")
    return errors
