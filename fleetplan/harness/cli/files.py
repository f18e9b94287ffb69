"""The command line's input files: read with an error that names the file, YAML or JSON parsed with
the line of a syntax error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def read_text(path: str, what: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        print(f"{path}: cannot read {what}: {exc.strerror or exc}", file=sys.stderr)
        return None


def load_yaml_or_json(text: str, path: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "?"
        raise ValueError(f"{path}: syntax error at {where}: {getattr(exc, 'problem', exc)}") from None
