"""Checkpoints on disk: written atomically, checked before anything is loaded.

A checkpoint is one file `step-XXXXXXXX.pt` plus a `latest` pointer. Both are written to a temp
file in the same directory, fsynced and renamed into place, so a crash at any moment leaves the
previous checkpoint whole and `latest` pointing at a complete file. Old checkpoints are pruned only
after the new one is in place; temp files a killed writer left behind go at the next save.

The file is a one-line header, `TILEWORK-CHECKPOINT <version> <length> <sha256>`, then the
`torch.save` payload. torch's own reader notices a cut-off file but not flipped bytes inside a
tensor, so the length and digest are checked before anything is decoded.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .atomic import write_atomic

FORMAT = "tilework-checkpoint"
VERSION = 2
MAGIC = b"TILEWORK-CHECKPOINT"
_TEMP_GLOB = ".*.tmp"


def write(path: str | Path, state: dict[str, Any], step: int | None = None,
          fingerprint: dict[str, Any] | None = None) -> Path:
    """One checkpoint file, atomically: header (length, digest), then the torch.save payload."""
    path = Path(path)
    _check_whole(state)
    for stale in path.parent.glob(_TEMP_GLOB):  # one writer per directory: these are a dead one's
        stale.unlink(missing_ok=True)
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "step": step,
                "fingerprint": fingerprint or {}, "state": state}, buffer)
    payload = buffer.getvalue()
    header = b"%s %d %d %s\n" % (MAGIC, VERSION, len(payload),
                                  hashlib.sha256(payload).hexdigest().encode())
    write_atomic(path, header + payload)
    return path


def _check_whole(state: Any, where: str = "state") -> None:
    """Refuse a tensor whose storage does not hold all of it (a sharded value freed between
    uses): torch.save would write a file its own reader refuses, after the last good one."""
    if torch.is_tensor(state):
        # Sparse and nested tensors own no strided storage of their own: torch.save checks them.
        if state.layout != torch.strided or state.is_nested or state.device.type == "meta" \
                or state.numel() == 0:
            return
        extent = (state.storage_offset() + sum((n - 1) * s for n, s in
                                               zip(state.shape, state.stride())) + 1)
        if state.untyped_storage().nbytes() < extent * state.element_size():
            raise CheckpointError(f"{where}: the tensor's storage holds "
                                  f"{state.untyped_storage().nbytes():,} of its "
                                  f"{extent * state.element_size():,} bytes (a sharded value "
                                  "freed between uses?); nothing was written")
    elif isinstance(state, dict):
        for key, value in state.items():
            _check_whole(value, f"{where}[{key!r}]")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            _check_whole(value, f"{where}[{i}]")


def save(directory: str | Path, step: int, state: dict[str, Any], fingerprint: dict[str, Any],
         keep: int = 2) -> Path:
    """A training run's checkpoint `step-XXXXXXXX.pt`, then `latest`, then pruning."""
    directory = Path(directory)
    path = write(directory / f"step-{step:08d}.pt", state, step, fingerprint)
    write_atomic(directory / "latest", path.name.encode())
    for old in sorted(directory.glob("step-*.pt"))[:-keep] if keep > 0 else []:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def latest(directory: str | Path) -> Path | None:
    pointer = Path(directory) / "latest"
    if not pointer.exists():
        return None
    return Path(directory) / pointer.read_text().strip()


def _payload(path: Path, data: bytes) -> bytes:
    """The torch.save bytes of a checkpoint file, after its length and digest are checked."""
    if not data.startswith(MAGIC):
        return data  # format 1 (no header): torch's reader and the version check below judge it
    end = data.find(b"\n")
    fields = data[:end].split() if end > 0 else []
    if len(fields) != 4 or not fields[2].isdigit():
        raise CheckpointError(f"{path}: damaged checkpoint header")
    length, digest = int(fields[2]), fields[3].decode(errors="replace")
    payload = data[end + 1:]
    if len(payload) != length:
        raise CheckpointError(f"{path}: truncated checkpoint: {len(payload):,} of {length:,} bytes "
                              "after the header")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: corrupted checkpoint: its contents no longer match the "
                              "SHA-256 written with them")
    return payload


def load(path: str | Path, fingerprint: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint's contents; refuses a damaged file or one made for a different job."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file not found")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        blob = torch.load(io.BytesIO(_payload(path, data)), map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to decode means a damaged file
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupted?): "
                              f"{type(e).__name__}") from None
    if isinstance(blob, dict) and blob.get("format") == "tilework-state":  # tilework.save, v1
        return {"format": FORMAT, "version": 1, "step": None, "fingerprint": {}, **blob}
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a tilework checkpoint")
    if blob.get("version") not in (1, VERSION):
        raise CheckpointError(f"{path}: checkpoint format version {blob.get('version')}, "
                              f"expected {VERSION}")
    if fingerprint is not None:
        saved = blob.get("fingerprint", {})
        diff = [k for k in sorted(set(saved) | set(fingerprint))
                if saved.get(k) != fingerprint.get(k)]
        if diff:
            k = diff[0]
            raise CheckpointError(f"{path}: made for a different job: {k} is {saved.get(k)!r} "
                                  f"there, {fingerprint.get(k)!r} here")
    return blob
