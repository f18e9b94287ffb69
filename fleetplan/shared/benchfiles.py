"""File reading and writing for benchmark files and PROFILES.json (the pure core gets text/dicts)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fleetplan.models.bench import BenchmarkFormatError, BenchmarkPoint, Metadata
from fleetplan.models.names import ModelAliases
from fleetplan.models.profile import ProfileError, ProfileSet
from fleetplan.models.readers import read_benchmark
from fleetplan.shared.atomic import atomic_write_text

BENCHMARK_SUFFIXES = (".json", ".csv")


class ProfilesFileError(ValueError):
    """PROFILES.json missing or invalid; the message names the file, field and value."""


def load_profiles(path: str | Path) -> ProfileSet:
    """Read a PROFILES.json written by `fleetplan models fit`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfilesFileError(f"{p}: cannot read profiles file: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfilesFileError(f"{p}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    try:
        return ProfileSet.from_json_dict(data)
    except ProfileError as exc:
        raise ProfilesFileError(f"{p}: {exc}") from exc


def save_profiles(path: str | Path, profiles: ProfileSet) -> None:
    """Write PROFILES.json atomically."""
    text = json.dumps(profiles.to_json_dict(), indent=2, sort_keys=False, allow_nan=False) + "\n"
    atomic_write_text(path, text)


def load_aliases(path: str | Path) -> ModelAliases:
    """A YAML/JSON mapping `canonical name: [spellings...]`."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{p}: cannot read aliases file: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{p}: invalid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ValueError(f"{p}: expected a mapping 'canonical: [spellings]', got {type(data).__name__}")
    table: dict[str, list[str]] = {}
    for canonical, spellings in data.items():
        if isinstance(spellings, str):
            spellings = [spellings]
        if not isinstance(spellings, list) or not all(isinstance(s, str) for s in spellings):
            raise ValueError(f"{p}: field {canonical!r}: expected a list of names, got {spellings!r}")
        table[str(canonical)] = spellings
    try:
        return ModelAliases.build(table)
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from exc


@dataclass
class ReadOutcome:
    points: list[BenchmarkPoint] = field(default_factory=list)
    files_read: int = 0
    bad: list[str] = field(default_factory=list)  # one line per skipped file: path and reason
    row_problems: list[str] = field(default_factory=list)  # rows skipped inside good files


def benchmark_files(paths: Iterable[str | Path], bad: list[str]) -> list[Path]:
    """Files named directly, plus every .json/.csv under the named directories (sorted)."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            inside = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in BENCHMARK_SUFFIXES
                            and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not inside:
                bad.append(f"{p}: directory holds no benchmark files (*.json, *.csv)")
            found.extend(inside)
        elif p.is_file():
            found.append(p)
        else:
            bad.append(f"{p}: no such file or directory")
    return found


def read_benchmark_paths(paths: Iterable[str | Path], meta: Metadata | None = None,
                         aliases: ModelAliases | None = None) -> ReadOutcome:
    """Read every benchmark file; a bad file is recorded with its reason and skipped."""
    out = ReadOutcome()
    for path in benchmark_files(paths, out.bad):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            out.bad.append(f"{path}: cannot read: {exc}")
            continue
        try:
            result = read_benchmark(text, str(path), meta, aliases)
        except BenchmarkFormatError as exc:
            out.bad.append(str(exc))
            continue
        out.files_read += 1
        out.points.extend(result.points)
        out.row_problems.extend(result.problems)
    return out
