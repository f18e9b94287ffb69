"""File reading and writing for benchmark files and PROFILES.json (the pure core gets text/dicts)."""

from __future__ import annotations

import json
from pathlib import Path

from controller.atomic import atomic_write_text
from models.profile import ProfileError, ProfileSet


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
