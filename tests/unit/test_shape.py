"""The tree's shape stays: no source file over 800 lines, no class over 400 (split by concern instead).

Every Python file of the repository counts (packages, bench/, scripts, tests), each once, at its one
path under fleetplan/ (the root names planner/, models/, controller/ and sim/ are links into it)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 400
SKIP_DIRS = {".venv", ".git", "build", "node_modules", "__pycache__"}


def _sources() -> list[Path]:
    out = []
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if SKIP_DIRS & set(rel.parts) or any(p.is_symlink() for p in (REPO / rel).parents if p != REPO):
            continue
        out.append(path)
    return sorted(out)


def test_the_walk_sees_every_package_once() -> None:
    sources = _sources()
    rels = {p.relative_to(REPO).as_posix() for p in sources}
    assert {"fleetplan/planner/core.py", "fleetplan/controller/daemon.py", "fleetplan/sim/des.py",
            "fleetplan/harness/cli/__init__.py"} <= rels
    assert len({p.resolve() for p in sources}) == len(sources)  # no file counted twice through a link


def test_each_package_has_one_path_and_the_root_names_link_to_it() -> None:
    # git, grep, tracebacks, mypy and the import contracts name a file the same way: the package is
    # a directory under fleetplan/, and the root name the layout keeps is a link to it
    import fleetplan.planner.core as core

    for name in ("planner", "models", "controller", "sim"):
        real = REPO / "fleetplan" / name
        assert real.is_dir() and not real.is_symlink(), real
        assert (REPO / name).is_symlink() and (REPO / name).resolve() == real, name
    assert Path(core.__file__).resolve() == (REPO / "fleetplan" / "planner" / "core.py")
    assert Path(core.__file__) == Path(core.__file__).resolve()  # the traceback's path is the real one


def test_no_file_over_800_lines_and_no_class_over_400() -> None:
    too_long: list[str] = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO).as_posix()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_long.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, filename=rel)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_long.append(f"{rel}:{node.lineno}: class {node.name} {size} lines (at most {MAX_CLASS_LINES})")
    assert not too_long, "split by concern:\n" + "\n".join(too_long)
