"""Checkpoints on disk: written atomically, checked before anything is loaded.

A checkpoint is one file `step-XXXXXXXX.pt` plus a `latest` pointer. Both are written to a temp
file in the same directory, fsynced and renamed into place, so a crash at any moment leaves the
previous checkpoint whole and `latest` pointing at a complete file. Old checkpoints are pruned only
after the new one is in place.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

FORMAT = "tilework-checkpoint"
VERSION = 1


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(directory: str | Path, step: int, state: dict[str, Any], fingerprint: dict[str, Any],
         keep: int = 2) -> Path:
    directory = Path(directory)
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "step": step, "fingerprint": fingerprint,
                "state": state}, buffer)
    path = directory / f"step-{step:08d}.pt"
    atomic_write_bytes(path, buffer.getvalue())
    atomic_write_bytes(directory / "latest", path.name.encode())
    for old in sorted(directory.glob("step-*.pt"))[:-keep] if keep > 0 else []:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def latest(directory: str | Path) -> Path | None:
    pointer = Path(directory) / "latest"
    if not pointer.exists():
        return None
    return Path(directory) / pointer.read_text().strip()


def load(path: str | Path, fingerprint: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint's contents; refuses a damaged file or one made for a different job."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file not found")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to decode means a damaged file
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupted?): "
                              f"{type(e).__name__}") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a tilework checkpoint")
    if blob.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {blob.get('version')}, "
                              f"expected {VERSION}")
    if fingerprint is not None:
        saved = blob.get("fingerprint", {})
        diff = [k for k in sorted(set(saved) | set(fingerprint)) if saved.get(k) != fingerprint.get(k)]
        if diff:
            k = diff[0]
            raise CheckpointError(f"{path}: made for a different job: {k} is {saved.get(k)!r} "
                                  f"there, {fingerprint.get(k)!r} here")
    return blob
