"""planner/ and models/ are pure: no I/O, no clock, no environment, no threads.

import-linter (run by the test command) forbids the modules; this test catches what an import
contract cannot see: builtins such as open() and print(), and clock/env reads through attributes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_PACKAGES = ("planner", "models")
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "breakpoint"}
FORBIDDEN_ATTRIBUTES = {
    ("datetime", "now"), ("datetime", "utcnow"), ("datetime", "today"), ("date", "today"),
    ("os", "environ"), ("os", "getenv"), ("time", "time"), ("time", "monotonic"),
}
FORBIDDEN_MODULES = {"os", "time", "asyncio", "threading", "subprocess", "socket", "random", "pathlib",
                     "sqlite3", "httpx", "aiohttp", "aiomqtt", "logging"}


def _pure_files() -> list[Path]:
    return sorted(p for pkg in PURE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _violations(source: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"line {node.lineno}: call to {node.func.id}()")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in FORBIDDEN_ATTRIBUTES:
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in FORBIDDEN_MODULES]
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"line {node.lineno}: from {node.module} import ...")
    return found


@pytest.mark.parametrize("path", _pure_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_does_no_io(path: Path) -> None:
    assert _violations(path.read_text()) == []


def test_the_checker_catches_io() -> None:
    bad = "import time\nfrom os import environ\nx = open('f')\nprint(x)\nimport datetime\ndatetime.now()\n"
    assert len(_violations(bad)) == 5
