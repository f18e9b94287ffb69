"""bench/controller_scale.py's simulated fleet, run in a child process: one simulated agent per host
on MQTT (statuses, desired states, acks) and the engines' load the fake Prometheus reports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ISL, OSL = 500, 200  # the synthetic models' mean prompt and output tokens
TEMPLATE = "vllm"  # the policy's default agent template for the engine
PORT_RANGE = (20000, 20099)


class SimAgent:
    """One host: the agent's MQTT conversation, no processes."""

    def __init__(self, fleet: FleetSim, host: str, user: str, password: str) -> None:
        self.fleet, self.host, self.user, self.password = fleet, host, user, password
        self.replicas: dict[str, Any] = {}  # replica id -> DesiredReplica
        self.state: dict[str, tuple[str, float]] = {}  # replica id -> (phase, since_s)
        self.desired: Any = None
        self.changed = asyncio.Event()
        self.connected = False
        self.acks = 0

    def limits(self) -> Any:
        from fleetplan.controller.protocol import HostLimits
        from fleetplan.models.names import Engine, GpuType

        return HostLimits(self.host, GpuType.H100, self.fleet.gpus, PORT_RANGE, {TEMPLATE: Engine.VLLM})

    def status_payload(self) -> bytes:
        from fleetplan.controller.protocol import HostStatus, ReplicaStatus, to_payload
        from fleetplan.models.names import Engine, GpuType

        reps = []
        for rid, r in sorted(self.replicas.items()):
            phase, since = self.state[rid]
            reps.append(ReplicaStatus(replica_id=rid, template=r.template, model=r.model, engine=r.engine,
                                      gpu=r.gpu, tp=r.tp, precision=r.precision, gpu_indices=r.gpu_indices,
                                      port=r.port, state=phase, since_s=since))  # type: ignore[arg-type]
        st = HostStatus(host=self.host, online=True, gpu=GpuType.H100, gpu_count=self.fleet.gpus,
                        nvlink_groups=(tuple(range(self.fleet.gpus)),), replicas=tuple(reps),
                        agent_version="bench-sim", updated_s=time.time(),
                        desired_version=self.desired.version if self.desired is not None else None,
                        port_range=PORT_RANGE, templates=(TEMPLATE,), template_engines={TEMPLATE: Engine.VLLM})
        return to_payload(st)

    def handle_desired(self, payload: bytes) -> Any:
        from fleetplan.controller.protocol import (
            Ack,
            ProtocolError,
            check_desired,
            check_version,
            parse_desired,
            payload_version,
        )

        if not payload.strip():
            return None
        now = time.time()
        try:
            desired = parse_desired(payload, host=self.host)
        except ProtocolError as exc:
            return Ack(version=payload_version(payload), accepted=False, errors=(str(exc),), host=self.host,
                       received_s=now)
        applied = self.desired.version if self.desired is not None else None
        reason = check_version(applied, desired.version)
        errors = [reason] if reason else check_desired(desired, self.limits())
        if errors:
            return Ack(version=desired.version, accepted=False, errors=tuple(errors), host=self.host, received_s=now)
        want = {r.replica_id: r for r in desired.replicas}
        for rid in list(self.replicas):
            if rid not in want or want[rid] != self.replicas[rid]:
                del self.replicas[rid]  # stopped at once: no engine to drain
                del self.state[rid]
        loop = asyncio.get_running_loop()
        for rid, r in want.items():
            if rid not in self.replicas:
                self.replicas[rid] = r
                self.state[rid] = ("starting", now)
                loop.call_later(self.fleet.ready_delay_s, self._ready, rid, r)
        self.desired = desired
        self.changed.set()
        return Ack(version=desired.version, accepted=True, host=self.host, received_s=now)

    def _ready(self, rid: str, spec: Any) -> None:
        if self.replicas.get(rid) is spec and self.state[rid][0] == "starting":
            self.state[rid] = ("ready", time.time())
            self.changed.set()

    async def run(self, connect_gate: asyncio.Semaphore) -> None:
        import aiomqtt

        from fleetplan.controller.mqtt import MqttSettings, client_kwargs
        from fleetplan.controller.protocol import desired_topic, status_topic

        settings = MqttSettings(host=self.fleet.mqtt_host, port=self.fleet.mqtt_port, username=self.user,
                                password=self.password, keepalive_s=60, client_id=self.user)
        will = aiomqtt.Will(status_topic(self.host), json.dumps({"host": self.host, "online": False}).encode(),
                            qos=1, retain=True)
        while True:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    async with connect_gate:  # a bounded number of connects at once
                        client = await stack.enter_async_context(aiomqtt.Client(**client_kwargs(settings), will=will))
                        await client.subscribe(desired_topic(self.host), qos=1)
                    self.connected = True
                    async with asyncio.TaskGroup() as group:
                        group.create_task(self._receive(client))
                        group.create_task(self._publish_loop(client))
            except* aiomqtt.MqttError as errors:
                self.fleet.errors[f"mqtt: {errors.exceptions[0]}"[:120]] += 1
            finally:
                self.connected = False
            await asyncio.sleep(0.5 + random.random())

    async def _receive(self, client: Any) -> None:
        from fleetplan.controller.protocol import ack_topic, to_payload

        async for message in client.messages:
            payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
            ack = self.handle_desired(bytes(payload))
            if ack is not None:
                self.acks += 1
                if not ack.accepted:
                    self.fleet.errors[f"rejected: {ack.errors[0]}"[:160]] += 1
                await client.publish(ack_topic(self.host), to_payload(ack), qos=1)

    async def _publish_loop(self, client: Any) -> None:
        from fleetplan.controller.protocol import status_topic

        # the first heartbeat at a random point of the interval: the hosts' heartbeats spread out
        first = True
        while True:
            self.changed.clear()
            await client.publish(status_topic(self.host), self.status_payload(), qos=1, retain=True)
            self.fleet.statuses_sent += 1
            interval = self.fleet.status_interval_s * (random.random() if first else 1.0)
            first = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=interval)
            await asyncio.sleep(0.05)  # coalesce bursts of changes, as the agent does


class FleetSim:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.mqtt_host: str = cfg["mqtt_host"]
        self.mqtt_port: int = cfg["mqtt_port"]
        self.gpus: int = cfg["gpus"]
        self.ready_delay_s: float = cfg["ready_delay_s"]
        self.status_interval_s: float = cfg["status_interval_s"]
        self.demand: dict[str, float] = cfg["demand"]
        self.agents = [SimAgent(self, h, u, p) for h, (u, p) in cfg["agents"].items()]
        self.errors: Counter[str] = Counter()
        self.statuses_sent = 0
        self.prom_queries = 0

    # ---- fake Prometheus: answers by what a query asks for, unknown queries get no series ------
    def _vector(self, expr: str, now: float) -> list[dict[str, Any]]:
        def per_model(fn: Callable[[str, float], float]) -> list[dict[str, Any]]:
            return [{"metric": {"model": m}, "value": [now, repr(fn(m, r))]} for m, r in self.demand.items()]

        ready = [(a.host, rid, spec) for a in self.agents for rid, spec in a.replicas.items()
                 if a.state[rid][0] == "ready"]

        def per_replica(value: float) -> list[dict[str, Any]]:
            return [{"metric": {"replica": rid}, "value": [now, repr(value)]} for _, rid, _ in ready]

        if expr.startswith("histogram_quantile("):
            q99 = expr.startswith("histogram_quantile(0.99")
            if "time_to_first_token" in expr:
                return per_model(lambda m, r: 0.45 if q99 else 0.2)
            return per_model(lambda m, r: 0.04 if q99 else 0.02)
        if expr.startswith("up{"):
            return [{"metric": {"__name__": "up", "replica": rid, "model": s.model, "job": "engines",
                                "instance": f"{host}:{s.port}"}, "value": [now, "1"]} for host, rid, s in ready]
        if expr.startswith("clamp_min("):
            return per_model(lambda m, r: r)
        if "bucket" in expr or "request_success" in expr:
            return []  # length/latency evidence: none (the profiles are trusted as they are)
        if expr.startswith(("sum by (replica)", "sum by (replica,")):
            return per_replica(1.0 if "running" in expr else 0.0)
        if "prompt_tokens" in expr:
            return per_model(lambda m, r: r * ISL)
        if "generation_tokens" in expr:
            return per_model(lambda m, r: r * OSL)
        if "kv_cache" in expr or "cache_usage" in expr:
            return per_model(lambda m, r: 0.3)
        if "num_requests_running" in expr:
            return per_model(lambda m, r: 0.0 if r == 0 else 4.0)
        if "num_requests_waiting" in expr:
            return per_model(lambda m, r: 0.0)
        return []

    def _matrix(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        if "request_success" not in expr:
            return []
        n = int((end - start) // step) + 1
        times = [start + i * step for i in range(n)]
        return [{"metric": {"model": m}, "values": [[t, repr(r)] for t in times]} for m, r in self.demand.items()]

    async def serve_prometheus(self, port: int) -> Any:
        from aiohttp import web

        async def query(request: web.Request) -> web.Response:
            self.prom_queries += 1
            p = request.query
            now = float(p.get("time", time.time()))
            if p.get("query") == "time()":  # the Observer evaluates every query at Prometheus's time
                return web.json_response({"status": "success", "data": {"resultType": "scalar",
                                                                        "result": [now, repr(now)]}})
            data = {"resultType": "vector", "result": self._vector(p.get("query", ""), now)}
            return web.json_response({"status": "success", "data": data})

        async def query_range(request: web.Request) -> web.Response:
            self.prom_queries += 1
            p = request.query
            result = self._matrix(p.get("query", ""), float(p["start"]), float(p["end"]), float(p["step"]))
            return web.json_response({"status": "success", "data": {"resultType": "matrix", "result": result}})

        app = web.Application()
        app.router.add_get("/api/v1/query", query)
        app.router.add_get("/api/v1/query_range", query_range)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner


async def _fleet_main(cfg: dict[str, Any]) -> None:
    sim = FleetSim(cfg)
    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    loop.add_signal_handler(signal.SIGINT, main.cancel)
    runner = await sim.serve_prometheus(cfg["prom_port"])
    gate = asyncio.Semaphore(64)
    tasks = [asyncio.create_task(a.run(gate)) for a in sim.agents]
    parent = os.getppid()
    try:
        while True:  # report, and die with the parent (no orphaned simulator)
            await asyncio.sleep(2.0)
            if os.getppid() != parent:
                return
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            errors = "; ".join(f"{n}x {e}" for e, n in sim.errors.most_common(3))
            print(json.dumps({"connected": sum(a.connected for a in sim.agents), "statuses": sim.statuses_sent,
                              "acks": sum(a.acks for a in sim.agents), "prom_queries": sim.prom_queries,
                              "rss_mb": round(rss), "errors": errors}), flush=True)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()


def fleet_child(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
        asyncio.run(_fleet_main(cfg))
    return 0
