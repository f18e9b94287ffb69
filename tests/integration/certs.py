"""TLS material for the TLS tests: throwaway CAs and the certificates they sign (the `openssl` CLI),
and a Mosquitto TLS listener started with them.

- `make_ca(d, name)` -> Ca: a self-signed CA (EC P-256, two days).
- `ca.issue(d, name, cn=..., usage=Usage.SERVER)`: a server certificate for 127.0.0.1/localhost;
  `Usage.CLIENT`: a client certificate whose CN is the MQTT user name when the broker has
  `use_identity_as_username true`.
- `tls_mosquitto(d, ca, server, hosts=..., require_certificate=...)`: Mosquitto 2.x on a free
  loopback port with the lab's users and ACL, stopped (with its process group) when the block ends.
"""

from __future__ import annotations

import contextlib
import enum
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetplan.harness.procs import ManagedProcess, free_port
from fleetplan.harness.servers import MosquittoServer

OPENSSL = shutil.which("openssl")
MOSQUITTO = "/usr/sbin/mosquitto"
NGINX = "/usr/sbin/nginx"
HAVE_OPENSSL = OPENSSL is not None


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


# EC keys: generated in milliseconds (RSA 2048 takes a noticeable part of a second each)
_NEW_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


class Usage(enum.Enum):
    SERVER = "serverAuth"
    CLIENT = "clientAuth"


@dataclass(frozen=True)
class CertKey:
    """A certificate (PEM) and its private key (PEM, unencrypted)."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Ca(CertKey):
    def issue(self, d: Path, name: str, *, cn: str, usage: Usage) -> CertKey:
        """A certificate signed by this CA, written to d/<name>.pem and d/<name>.key. Extensions
        as strict verifiers (Python's VERIFY_X509_STRICT) want them: key identifiers, CA:FALSE,
        the extended key usage, and for a server the loopback names."""
        lines = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature",
                 f"extendedKeyUsage={usage.value}", "subjectKeyIdentifier=hash",
                 "authorityKeyIdentifier=keyid"]
        if usage is Usage.SERVER:
            lines.append("subjectAltName=IP:127.0.0.1,DNS:localhost")
        (d / f"{name}.ext").write_text("\n".join(lines) + "\n")
        _openssl("req", *_NEW_KEY, "-subj", f"/CN={cn}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(self.cert), "-CAkey", str(self.key),
                 "-CAcreateserial", "-CAserial", f"{self.cert.stem}.srl", "-days", "2",
                 "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
        return CertKey(d / f"{name}.pem", d / f"{name}.key")


def make_ca(d: Path, name: str) -> Ca:
    """A self-signed CA, d/<name>.pem and d/<name>.key."""
    _openssl("req", "-x509", *_NEW_KEY, "-days", "2", "-subj", f"/CN={name} test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)
    return Ca(d / f"{name}.pem", d / f"{name}.key")


@dataclass(frozen=True)
class Broker:
    port: int
    users: MosquittoServer  # the lab's users and ACL (never started): controller, observer, agent-<host>
    proc: ManagedProcess


@contextlib.contextmanager
def tls_mosquitto(d: Path, ca: Ca, server: CertKey, *, hosts: Sequence[str],
                  require_certificate: bool) -> Iterator[Broker]:
    """Mosquitto with one TLS listener on 127.0.0.1, no anonymous access, and the lab's users and
    ACL (`MosquittoServer.acl_text`: controller, observer, agent-<host> for each of `hosts`).

    `require_certificate`: clients must present a certificate signed by `ca`, and its CN is their
    user name (`use_identity_as_username`); otherwise they log in with the lab's passwords. The
    client id is the user name either way (`use_username_as_clientid`), so one client's identity
    cannot take over another's session."""
    users = MosquittoServer(d, host_names=tuple(hosts))
    port = free_port()
    lines = [f"listener {port} 127.0.0.1", "allow_anonymous false", f"acl_file {d / 'acl'}",
             "use_username_as_clientid true", f"cafile {ca.cert}", f"certfile {server.cert}",
             f"keyfile {server.key}", "log_dest stderr", "connection_messages true"]
    if require_certificate:
        lines += ["require_certificate true", "use_identity_as_username true"]
    else:
        logins = [users.controller, users.observer, *users.agents.values()]
        (d / "passwd").write_text("".join(f"{u.user}:{u.password}\n" for u in logins))
        (d / "passwd").chmod(0o600)
        subprocess.run(["mosquitto_passwd", "-U", str(d / "passwd")], check=True, capture_output=True, timeout=30)
        lines.append(f"password_file {d / 'passwd'}")
    if os.geteuid() == 0:  # otherwise mosquitto drops to user "mosquitto" and cannot read our files
        lines.append("user root")
    (d / "acl").write_text(users.acl_text() + "\n")
    (d / "mosquitto.conf").write_text("\n".join(lines) + "\n")
    proc = ManagedProcess("mosquitto", [MOSQUITTO, "-c", str(d / "mosquitto.conf")], d / "mosquitto.log")
    proc.start()
    try:
        proc.wait_ready(lambda: " running" in proc.log_text(), 15.0, f"listening on 127.0.0.1:{port}")
        yield Broker(port, users, proc)
    finally:
        proc.stop()
