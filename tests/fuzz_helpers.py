"""What the fuzz properties share (tests/unit/controller/test_wire_fuzz.py, tests/unit/models/test_bench_fuzz.py)."""

from __future__ import annotations

import json
from typing import Any


def value_slots(doc: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every value inside `doc` (dicts and lists, any depth): the places a
    mutation can replace, delete or rename."""
    out: list[tuple[Any, Any]] = []
    stack = [doc]
    while stack:
        c = stack.pop()
        items = list(c.items()) if isinstance(c, dict) else list(enumerate(c)) if isinstance(c, list) else []
        for k, v in items:
            out.append((c, k))
            stack.append(v)
    return out


class Raw:
    """A JSON token json.dumps cannot write (NaN, 1e999, a 5,000-digit integer, deep nesting)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:20]!r}...)"


def raw_json(doc: Any) -> str:
    """json.dumps with Raw tokens spliced in."""
    raws: list[str] = []

    def default(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        raise TypeError(type(value).__name__)

    text = json.dumps(doc, default=default)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), raw, 1)
    return text
