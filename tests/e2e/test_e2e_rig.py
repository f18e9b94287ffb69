"""Rig.stop stops every process the rig's agents launched, whatever the engine's command is.

The agents leave their engines running when they stop (by design: an agent restart must not stop
serving), so the rig must stop them itself. The engine here is not `fleetplan sim-engine` (a real
vLLM was left running by a name match on "sim-engine"): a small HTTP server that, like vLLM, starts
a worker in its process group, plus one that leaves the group (setsid).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import aiomqtt
import pytest

from fleetplan.controller.protocol import desired_topic
from fleetplan.harness.demo import Rig
from fleetplan.harness.rig_tools import wait_until

pytestmark = pytest.mark.e2e

FAKE_ENGINE = """
import http.server, json, os, subprocess, sys
port, pid_file = int(sys.argv[1]), sys.argv[2]
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
worker = subprocess.Popen(sleeper)  # in the engine's process group, like vLLM's engine core
escaped = subprocess.Popen(sleeper, start_new_session=True)  # a process that left the group
tmp = pid_file + ".tmp"
with open(tmp, "w") as f:
    json.dump({"engine": os.getpid(), "worker": worker.pid, "escaped": escaped.pid}, f)
os.replace(tmp, pid_file)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def test_rig_stop_stops_every_process_its_agents_launched(tmp_path: Path) -> None:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    pid_file = tmp_path / "pids.json"
    template = {"engine": "vllm", "argv": [sys.executable, str(script), "{port}", str(pid_file)],
                "health_path": "/health", "startup_timeout_s": 60, "stop_timeout_s": 5}
    rig = Rig(tmp_path / "rig", hosts=1, gpus_per_host=1, launch_templates={"vllm": template})
    pids: dict[str, int] = {}
    try:
        rig.start()
        host = rig.lab.hosts[0]
        desired = {"version": 1, "replicas": [{
            "replica_id": "fake-0", "template": "vllm", "model": "llama-3.1-8b", "engine": "vllm", "gpu": "h100",
            "tp": 1, "precision": "bf16", "gpu_indices": [0], "port": host.port_range[0]}]}
        async with aiomqtt.Client(rig.lab.mqtt_host, rig.lab.mqtt_port, username=rig.lab.controller_user,
                                  password=rig.lab.controller_password,
                                  protocol=aiomqtt.ProtocolVersion.V5) as client:
            await client.publish(desired_topic(host.name), json.dumps(desired), qos=1, retain=True)
        await wait_until(pid_file.exists, 60, "the agent launching the engine", poll_s=0.2)
        pids = json.loads(pid_file.read_text())
        await wait_until(lambda: "fake-0" in rig.engine_pids(), 30, "the agent's record of the engine", poll_s=0.2)
        assert all(_alive(p) for p in pids.values()), pids
        assert set(pids.values()) <= rig.launched_processes()
        rig.stop()
        assert {name: _alive(p) for name, p in pids.items()} == {name: False for name in pids}
        assert rig.launched_processes() == set()
    finally:
        rig.stop()  # idempotent; and whatever a failed assertion left running
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
