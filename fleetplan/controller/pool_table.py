"""The pool proxy's upstreams: per model, the prefill and the decode replicas' base URLs, read from a
JSON file (`fleetplan.controller.pool_proxy`), and the least-outstanding pick on each side.

The file (written atomically by whoever owns it: `fleetplan.shared.atomic`):

    {"models": {"llama-3.1-8b": {"prefill": ["http://10.0.0.5:8001", "http://10.0.0.6:8001"],
                                 "decode": [{"url": "http://10.0.0.7:8002", "host": "gpu-07"}]}}}

Models are matched spelling-insensitively (`models.names.model_key`). An upstream is a base URL
`http(s)://host:port` (no path: the proxy appends the request's `/v1/...` path), or an object with
that `url` and the `host` the replica runs on (the fleet's host name, as the daemon writes it): a
prefill leg's KV then goes to a decode replica on the same host when one is within its load bound
(`planner.kv_route`), over NVLink instead of the network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from urllib.parse import urlsplit

from fleetplan.models.names import model_key
from fleetplan.planner.kv_route import decode_choices

log = logging.getLogger(__name__)

__all__ = ["ModelPools", "PoolTable", "Side", "TableError", "Upstream", "UpstreamsFile", "parse_table", "render_table",
           "table_before_router", "table_generation"]


class Side(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class TableError(ValueError):
    """The upstreams file is unreadable or malformed (the message names the file, field and value)."""


@dataclass(frozen=True)
class ModelPools:
    name: str  # as the file spells it (the metrics' model label)
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    hosts: tuple[tuple[str, str], ...] = ()  # (URL, the host it runs on) where known

    def side(self, side: Side) -> tuple[str, ...]:
        return self.prefill if side is Side.PREFILL else self.decode

    @cached_property
    def _host_of(self) -> dict[str, str]:
        return dict(self.hosts)

    def host(self, url: str) -> str | None:
        """The host `url` runs on; None: not known (a lookup: the proxy asks it per candidate per leg)."""
        return self._host_of.get(url)

    def joined(self, other: ModelPools) -> ModelPools:
        """Each side's URLs of `self`, then those of `other` not in it."""
        return ModelPools(self.name, tuple(dict.fromkeys((*self.prefill, *other.prefill))),
                          tuple(dict.fromkeys((*self.decode, *other.decode))),
                          tuple(dict.fromkeys((*self.hosts, *(uh for uh in other.hosts
                                                               if self.host(uh[0]) is None)))))


PoolTable = Mapping[str, ModelPools]  # model_key -> pools


def _base_url(path: Path, field: str, raw: object) -> str:
    if not isinstance(raw, str):
        raise TableError(f"{path}: {field} must be a URL string, got {raw!r}")
    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise TableError(f"{path}: {field} must be a base URL http(s)://host:port, got {raw!r}")
    try:
        parts.port  # noqa: B018  (raises on a malformed port)
    except ValueError as exc:
        raise TableError(f"{path}: {field} has a bad port: {raw!r}") from exc
    return url


def _upstream(path: Path, field: str, raw: object) -> tuple[str, str | None]:
    """(base URL, host or None) of one upstream entry: a URL string or {"url": ..., "host": ...}."""
    if not isinstance(raw, dict):
        return _base_url(path, field, raw), None
    unknown = set(raw) - {"url", "host"}
    if unknown:
        raise TableError(f"{path}: {field} has unknown fields {sorted(unknown)} (url, host)")
    host = raw.get("host")
    if host is not None and (not isinstance(host, str) or not host.strip()):
        raise TableError(f"{path}: {field}.host must be a host name, got {host!r}")
    return _base_url(path, f"{field}.url", raw.get("url")), host


def parse_table(path: Path, text: str) -> PoolTable:
    """The pools of every model in `text` (the content of `path`); TableError when malformed."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TableError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        raise TableError(f"{path}: models must be an object of model name -> pools, got {doc!r:.80}")
    table: dict[str, ModelPools] = {}
    for name, pools in doc["models"].items():
        if not isinstance(pools, dict):
            raise TableError(f"{path}: models.{name} must be an object with prefill and decode lists, got {pools!r}")
        unknown = set(pools) - {"prefill", "decode"}
        if unknown:
            raise TableError(f"{path}: models.{name} has unknown fields {sorted(unknown)} (prefill, decode)")
        sides: dict[str, tuple[str, ...]] = {}
        hosts: dict[str, str] = {}
        for side in Side:
            raw = pools.get(side.value, [])
            if not isinstance(raw, list):
                raise TableError(f"{path}: models.{name}.{side.value} must be a list of URLs, got {raw!r}")
            urls = []
            for i, entry in enumerate(raw):
                url, host = _upstream(path, f"models.{name}.{side.value}[{i}]", entry)
                urls.append(url)
                if host is not None:
                    hosts[url] = host
            sides[side.value] = tuple(dict.fromkeys(urls))  # a URL named twice is one upstream
        key = model_key(name)
        if key in table:
            raise TableError(f"{path}: models.{name} names the same model as models.{table[key].name}")
        table[key] = ModelPools(name, sides["prefill"], sides["decode"], tuple(sorted(hosts.items())))
    return MappingProxyType(table)


def table_generation(text: str) -> str:
    """The content hash of an upstreams file's text: the proxy's /health names the one it serves,
    so a writer knows when the proxy took a new table (as nginx's routing generation)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def render_table(pools: Iterable[ModelPools]) -> str:
    """The upstreams file of `pools` (what `parse_table` reads back); deterministic: models and URLs
    sorted, so an unchanged table renders the same text.

    >>> print(render_table([ModelPools("m", ("http://10.0.0.5:8001",), ())]), end="")
    {
      "models": {
        "m": {
          "decode": [],
          "prefill": [
            "http://10.0.0.5:8001"
          ]
        }
      }
    }
    """
    def entries(p: ModelPools, urls: tuple[str, ...]) -> list[object]:
        return [u if p.host(u) is None else {"host": p.host(u), "url": u} for u in sorted(set(urls))]

    doc = {"models": {p.name: {"prefill": entries(p, p.prefill), "decode": entries(p, p.decode)}
                      for p in sorted(pools, key=lambda p: p.name)}}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def table_before_router(current: Mapping[str, ModelPools], new: Mapping[str, ModelPools],
                        leaving: Iterable[str]) -> dict[str, ModelPools]:
    """The table to write before the router is reloaded, `new` being the one to write after: for a
    model the proxy joins the router's upstream, its pools are in the file before the proxy gets its
    first request; for a model in `leaving` (the proxy leaves its upstream), the file keeps the
    replicas of `current` until the router no longer sends it there (requests reaching the proxy
    meanwhile find both sides), and they go with the write after.

    >>> cur = {"m": ModelPools("m", ("http://p1:1",), ("http://d1:1",))}
    >>> table_before_router(cur, {"m": ModelPools("m", (), ("http://d1:1",))}, ["m"])["m"]
    ModelPools(name='m', prefill=('http://p1:1',), decode=('http://d1:1',))
    >>> table_before_router(cur, {}, ["m"]) == cur
    True
    >>> table_before_router({}, cur, []) == cur  # joining: the pools first
    True
    """
    out = dict(new)
    for m in leaving:
        if m in current:
            out[m] = current[m] if m not in out else current[m].joined(out[m])
    return out


class Upstream:
    """One replica the proxy sends legs to, and its legs in flight."""

    __slots__ = ("outstanding", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.outstanding = 0


class UpstreamsFile:
    """The table read from a file, re-read when the file changes (`refresh`), and the replicas'
    outstanding legs (kept across reloads: a replica in both tables keeps its count)."""

    def __init__(self, path: Path, rng: random.Random | None = None) -> None:
        self.path = path
        self._rng = rng or random.Random()
        self._stamp: tuple[int, int, int] | None = None
        self.table: PoolTable = MappingProxyType({})
        self.generation: str | None = None  # table_generation of the text the table was read from
        self._upstreams: dict[str, Upstream] = {}
        self.reloads = 0

    def load(self) -> None:
        """Read the file now; OSError / TableError when it cannot be read or is malformed."""
        st = os.stat(self.path)
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TableError(f"{self.path}: not UTF-8 text: {exc}") from exc
        table = parse_table(self.path, text)
        self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        self.table = table
        self.generation = table_generation(text)
        self.reloads += 1
        live = {u for pools in table.values() for side in Side for u in pools.side(side)}
        for url in [u for u, up in self._upstreams.items() if u not in live and up.outstanding == 0]:
            del self._upstreams[url]
        log.info("pool proxy: %s: %d models", self.path, len(table))

    def refresh(self) -> bool:
        """Re-read the file when it changed since the last read (True: a new table). A file that is
        gone or malformed keeps the last table (logged)."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if self._stamp is not None:
                log.error("pool proxy: %s: %s (keeping the last table)", self.path, exc.strerror or exc)
                self._stamp = None
            return False
        if (st.st_mtime_ns, st.st_size, st.st_ino) == self._stamp:
            return False
        try:
            self.load()
        except (OSError, TableError) as exc:
            self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)  # not re-read until it changes again
            log.error("pool proxy: %s (keeping the last table)", exc)
            return False
        return True

    def pools(self, model: str) -> ModelPools | None:
        return self.table.get(model_key(model))

    def pick(self, pools: ModelPools, side: Side, exclude: Iterable[str] = (),
             near: str | None = None) -> Upstream | None:
        """The replica of `side` with the fewest legs in flight (ties: at random), not in `exclude`
        unless it is the only one left, on the host of the URL `near` when one there is within the
        load bound (`planner.kv_route.decode_choices`); None: the side has no replica."""
        urls = pools.side(side)
        if not urls:
            return None
        skip = set(exclude)
        candidates = [u for u in urls if u not in skip] or list(urls)
        ups = [self._upstreams.setdefault(u, Upstream(u)) for u in candidates]
        choices = decode_choices([up.outstanding for up in ups], [pools.host(u) for u in candidates],
                                 pools.host(near) if near is not None else None)
        return ups[self._rng.choice(choices)]
