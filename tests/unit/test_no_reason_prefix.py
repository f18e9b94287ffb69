"""No reason string used as data: in planner/, controller/ and sim/, no `startswith` (or `endswith`)
asks a binding, key, reason, note, alert or constraint what it is. Such a value is typed (an enum kind
and a subject: counts.Binding, act_types.AlertKey); its text is what a reader sees.

The check is on the syntax tree: the receiver of the call (a name, an attribute, a subscript's base),
or the loop variable of a `for`/comprehension over such a value, named like one of those."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("fleetplan/planner", "fleetplan/controller", "fleetplan/sim")
DATA_NAME = re.compile(r"(binding|key|reason|why|note|alert|constraint)", re.IGNORECASE)
PREFIX_CALLS = {"startswith", "endswith"}


def _name(node: ast.expr) -> str | None:
    """The name a receiver is known by: `x`, `a.x`, `x[i]`, `a.x[i]` -> "x"; a call's result: None."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _loop_names(tree: ast.AST) -> set[str]:
    """Loop variables over a data-named iterable (`for b in binding`, `... for k in alerts`)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        pairs: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(node, ast.For | ast.AsyncFor):
            pairs.append((node.target, node.iter))
        elif isinstance(node, ast.comprehension):
            pairs.append((node.target, node.iter))
        for target, it in pairs:
            base = it.func.value if (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
                                     and it.func.attr in {"items", "keys", "values"}) else it
            name = _name(base)
            if name is None or not DATA_NAME.search(name):
                continue
            first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
            if isinstance(first, ast.Name):
                out.add(first.id)
    return out


def offences(source: str, filename: str = "<src>") -> list[str]:
    """`file:line name.startswith(...)` for each prefix test on a data-named value."""
    tree = ast.parse(source, filename)
    loops = _loop_names(tree)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in PREFIX_CALLS):
            continue
        name = _name(node.func.value)
        if name is not None and (DATA_NAME.search(name) or name in loops):
            out.append(f"{filename}:{node.lineno} {name}.{node.func.attr}(...)")
    return out


def test_the_check_finds_prefix_tests_on_reasons_and_keys() -> None:
    # the shapes this tree had: a binding's text, an alert key, a loop over either
    assert offences('any(b.startswith("budget max_gpus") for b in solution.binding)')
    assert offences('if key.startswith(("orphan/", "rejected/")): pass')
    assert offences('{k for k in ctrl.runtime_alerts if k.startswith("inventory/")}')
    assert offences('[k for k, v in alerts.items() if k.startswith("x")]')
    assert offences('d.reason.startswith("fail static")')
    assert offences('constraint.startswith(("inventory", "budget"))')
    # parsing external input is not this
    assert not offences('line.startswith(b"data:")')
    assert not offences('stripped.startswith("{")')
    assert not offences('self.health_path.startswith("/")')


def test_no_prefix_test_on_a_reason_or_key_in_the_packages() -> None:
    found = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            found += offences(path.read_text(), path.relative_to(REPO).as_posix())
    assert not found, "typed kinds, not prefixes of their text:\n" + "\n".join(found)
