"""The report API over TLS behind nginx, as documented (config/nginx-report-tls.conf, docs/controller.md
"TLS"): a real nginx runs that very file (its port, certificate paths and upstream replaced) in front
of the real report server on loopback, with a certificate from a throwaway CA. Through it a request
without the bearer token is refused (401) and one with it is served; the CLI's client reaches it with
the CA in SSL_CERT_FILE. And the daemon refuses a report listener off loopback without a token
before it opens anything."""

from __future__ import annotations

import asyncio
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.report import fetch, post, start_report_server
from fleetplan.controller.state import StateStore
from fleetplan.harness.cli import main
from fleetplan.harness.procs import free_port
from fleetplan.harness.servers import NginxServer
from tests.integration.certs import HAVE_OPENSSL, NGINX, Usage, make_ca

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config/nginx-report-tls.conf"
TOKEN = "tls-s3cret"

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL or not Path(NGINX).exists(), reason="openssl or nginx not installed")


@dataclass(frozen=True)
class Front:
    url: str  # https://127.0.0.1:<port>, nginx's TLS server
    report_listen: str  # where the report API must listen (the example's upstream, moved)
    ca_file: Path  # the CA that signed nginx's certificate


def _example_for(port: int, cert: Path, key: Path, upstream: str) -> str:
    """The example file with the test's port, certificate and upstream; each must be in it once
    (an edit of the example that drops one fails here, not silently)."""
    text = EXAMPLE.read_text()
    for old, new in (("listen 9443 ssl;", f"listen 127.0.0.1:{port} ssl;"),
                     ("/etc/fleetplan/tls/report.pem", str(cert)), ("/etc/fleetplan/tls/report.key", str(key)),
                     ("http://127.0.0.1:9470", f"http://{upstream}")):
        assert text.count(old) == 1, f"{EXAMPLE}: expected {old!r} once"
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    with tempfile.TemporaryDirectory(prefix="fleetplan-report-tls-") as tmp:
        d = Path(tmp)
        ca = make_ca(d, "ca")
        server = ca.issue(d, "report", cn="127.0.0.1", usage=Usage.SERVER)
        port, upstream = free_port(), f"127.0.0.1:{free_port()}"
        nginx = NginxServer(d / "nginx", extra_http=_example_for(port, server.cert, server.key, upstream))
        nginx.start()  # nginx -t, then waits until it serves (one config: the TLS server is up too)
        try:
            yield Front(f"https://127.0.0.1:{port}", upstream, ca.cert)
        finally:
            nginx.stop()


async def test_report_api_behind_nginx_tls_needs_the_token(front: Front, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl = Controller(ControllerSettings(), ROOT / "config/example-policy.yaml", None, StateStore(tmp_path / "s.db"))
    assert ctrl.load_policy(initial=True)
    runner, _ = await start_report_server(ctrl, front.report_listen, TOKEN)
    try:
        verify = ssl.create_default_context(cafile=str(front.ca_file))
        async with httpx.AsyncClient(verify=verify, timeout=10) as c:
            assert (await c.get(front.url + "/api/report")).status_code == 401
            wrong = await c.get(front.url + "/api/report", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json() == {"error": "bearer token required"}
            assert (await c.post(front.url + "/api/pause", json={"reason": "x"})).status_code == 401
            ok = await c.get(front.url + "/api/report", headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200 and "alerts" in ok.json()
            assert (await c.get(front.url + "/healthz")).status_code in (200, 503)  # open: no 401
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # it is TLS, verified
            async with httpx.AsyncClient(timeout=10) as c:  # certifi's roots only
                await c.get(front.url + "/healthz")

        # on-call's CLI (`fleetplan report --url https://... --token ...`) with the CA in SSL_CERT_FILE
        monkeypatch.setenv("SSL_CERT_FILE", str(front.ca_file))
        report = await asyncio.to_thread(fetch, front.url, "/api/report", TOKEN)
        assert report.keys() == ok.json().keys()
        with pytest.raises(RuntimeError, match="401"):
            await asyncio.to_thread(fetch, front.url, "/api/report", None)
        paused = await asyncio.to_thread(post, front.url, "/api/pause", {"reason": "over tls"}, TOKEN)
        assert paused["paused"] is True and paused["reason"] == "over tls"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("listen", ["0.0.0.0:9470", "[::]:9470", "10.0.0.5:9470"])
def test_the_daemon_refuses_a_report_listener_off_loopback_without_a_token(
        listen: str, tmp_path: Path) -> None:
    (tmp_path / "controller.yaml").write_text("{}\n")  # not /etc/fleetplan/controller.yaml
    db = tmp_path / "state.db"
    with pytest.raises(SystemExit, match="bearer token is required when not bound to loopback"):
        main(["controller", "--policy", str(ROOT / "config/example-policy.yaml"), "--config",
              str(tmp_path / "controller.yaml"), "--state-db", str(db), "--report-listen", listen])
    assert not db.exists()  # refused before opening anything
