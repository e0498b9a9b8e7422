"""What a launcher tells a worker through its environment, read once, checked, and passed down.

    env = WorkerEnv.from_environ()        # in an entry point: the CLI, a worker's main, a script
    child = {**os.environ, **env.to_environ()}   # what a worker started by hand needs

torchrun, `tilework run` and the benchmarks describe each worker with environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, ...; `tilework run --timeout` adds TILEWORK_TIMEOUT_S). Only the
entry points read them (tests/cluster/test_worker_env.py checks which modules touch os.environ);
everything below receives a `WorkerEnv` or the values from it, so that a bad value fails once,
in one line naming the variable, not as a ValueError deep inside a worker.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from ..errors import UserError

TIMEOUT_ENV = "TILEWORK_TIMEOUT_S"   # set by `tilework run --timeout` for its workers
DEFAULT_TIMEOUT_S = 300.0

T = TypeVar("T")


class EnvError(UserError):
    """An environment variable a worker reads holds a value it cannot use."""

    def __init__(self, name: str, expected: str, value: str):
        super().__init__(f"environment variable {name}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class WorkerEnv:
    """One process's place in a launched group; the defaults are a process started by hand."""

    launched: bool = False              # RANK is set: this process is one rank of a group
    rank: int = 0                       # RANK
    world_size: int = 1                 # WORLD_SIZE
    local_rank: int = 0                 # LOCAL_RANK: picks the GPU
    local_world_size: int = 1           # LOCAL_WORLD_SIZE (default: WORLD_SIZE)
    group_rank: int | None = None       # GROUP_RANK: this host's index; None: the hostname says
    master_addr: str | None = None      # MASTER_ADDR, MASTER_PORT: where init_method env:// meets
    master_port: int | None = None
    timeout_s: float | None = None      # TILEWORK_TIMEOUT_S; None: DEFAULT_TIMEOUT_S
    restart_count: int = 0              # TORCHELASTIC_RESTART_COUNT: > 0 after `--max-restarts`
    error_file: str | None = None       # TORCHELASTIC_ERROR_FILE: where a failure is reported
    cache_home: str | None = None       # XDG_CACHE_HOME

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "WorkerEnv":
        get = _reader(environ)
        world = get("WORLD_SIZE", _count, "an integer >= 1", 1)
        rank = get("RANK", _index, "an integer >= 0", 0)
        if rank >= world:
            raise EnvError("RANK", f"less than WORLD_SIZE ({world})", environ["RANK"])
        local_world = get("LOCAL_WORLD_SIZE", _count, "an integer >= 1", world)
        local_rank = get("LOCAL_RANK", _index, "an integer >= 0", 0)
        if local_rank >= local_world:
            raise EnvError("LOCAL_RANK", f"less than LOCAL_WORLD_SIZE ({local_world})",
                           environ["LOCAL_RANK"])
        return cls(
            launched="RANK" in environ, rank=rank, world_size=world, local_rank=local_rank,
            local_world_size=local_world, group_rank=get("GROUP_RANK", _index, "an integer >= 0"),
            master_addr=environ.get("MASTER_ADDR") or None,
            master_port=get("MASTER_PORT", _port, "a port number (1 to 65535)"),
            timeout_s=get(TIMEOUT_ENV, _seconds, "a positive number of seconds"),
            restart_count=get("TORCHELASTIC_RESTART_COUNT", _index, "an integer >= 0", 0),
            error_file=environ.get("TORCHELASTIC_ERROR_FILE") or None,
            cache_home=environ.get("XDG_CACHE_HOME") or None)

    def to_environ(self) -> dict[str, str]:
        """The variables that make a child process this rank (as `from_environ` reads them)."""
        out = {"RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
               "LOCAL_WORLD_SIZE": self.local_world_size, "GROUP_RANK": self.group_rank,
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": self.master_port,
               TIMEOUT_ENV: self.timeout_s, "TORCHELASTIC_RESTART_COUNT": self.restart_count,
               "TORCHELASTIC_ERROR_FILE": self.error_file, "XDG_CACHE_HOME": self.cache_home}
        return {k: str(v) for k, v in out.items() if v is not None}

    @property
    def collective_timeout_s(self) -> float:
        """How long a collective waits for a silent peer before it fails (`--timeout`)."""
        return self.timeout_s or DEFAULT_TIMEOUT_S

    @property
    def cache_dir(self) -> Path:
        """Where tilework caches what it builds once (the stdlib corpus)."""
        return Path(self.cache_home or Path.home() / ".cache") / "tilework"


def _reader(environ: Mapping[str, str]):
    def get(name: str, parse: Callable[[str], T | None], expected: str, default=None):
        text = environ.get(name, "").strip()
        if not text:  # unset or empty: the default, as tilework read them before
            return default
        value = parse(text)
        if value is None:
            raise EnvError(name, expected, environ[name])
        return value
    return get


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _index(text: str) -> int | None:
    n = _int(text)
    return n if n is not None and n >= 0 else None


def _count(text: str) -> int | None:
    n = _int(text)
    return n if n is not None and n >= 1 else None


def _port(text: str) -> int | None:
    n = _int(text)
    return n if n is not None and 1 <= n <= 65535 else None


def _seconds(text: str) -> float | None:
    try:
        s = float(text)
    except ValueError:
        return None
    return s if 0 < s < math.inf else None


def record_for_launcher(line: str, path: str | None) -> None:
    """Leave `line` where the elastic agent looks for a worker's reason to fail
    (TORCHELASTIC_ERROR_FILE: `WorkerEnv.error_file`), if it gave a place."""
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the launcher falls back to the exit code
