"""Atomic file writes: readers never see a half-written file.

Every file that another process reads while we may be rewriting it (nginx upstreams, Prometheus
file_sd targets, endpoints JSON, agent environment files, state snapshots) goes through here:
the text is written to a temporary file in the SAME directory (so `os.replace` is a rename on
one filesystem), flushed and fsynced, then renamed over the target, and the directory is fsynced
so the rename survives a crash.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """Write `data` to `path` atomically (temp file in the same dir + fsync + os.replace).

    `mode`: permission bits of the new file; by default the old file's mode is kept, or 0o644
    for a new file (tempfile would otherwise create it 0o600, unreadable by e.g. nginx workers).
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if mode is None:
        try:
            mode = target.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(directory)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8", mode: int | None = None
) -> None:
    """Write `text` to `path` atomically (temp file in the same dir + fsync + os.replace)."""
    atomic_write_bytes(path, text.encode(encoding), mode=mode)


def _fsync_dir(directory: Path) -> None:
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds; the rename itself is still atomic
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
