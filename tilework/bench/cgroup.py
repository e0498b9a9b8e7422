"""Cgroups of their own for worker processes: a memory cap with a real out-of-memory kill past
it (`MemoryCap`), and a CPU quota that makes a rank as fast as a smaller host (`CpuQuota`).

cgroup v2 where its memory controller is enabled (memory.max, memory.swap.max = 0); else cgroup
v1 (memory.limit_in_bytes and memory.memsw.limit_in_bytes both at the cap). The group is made
inside this process's own memory cgroup, so every limit above it still applies; `remove` it at
the end. Needs root. Used by bench/zero_capacity.py (the largest model under a cap) and
bench/planner_memory.py (no plan estimated under 80% of a cap is killed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


class _Group:
    """A cgroup directory of our own: its files, joining it, removing it."""

    path: str

    def _write(self, name: str, value) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def join(self, pid: int | None = None) -> None:
        """Move process `pid` (default: this one, as a preexec_fn) and every thread of it in."""
        self._write("cgroup.procs", pid or os.getpid())

    def remove(self) -> None:
        os.rmdir(self.path)


class MemoryCap(_Group):
    """A memory cgroup with `limit` bytes and no swap, inside this process's own; `join` is a
    preexec_fn that moves a starting worker into it."""

    def __init__(self, limit: int, name: str = "capacity"):
        self.version, parent = _own_memory_cgroup()
        self.path = os.path.join(parent, f"tilework-{name}-{os.getpid()}")
        os.mkdir(self.path)
        try:
            self.set_limit(limit)
        except OSError:
            os.rmdir(self.path)
            raise

    def set_limit(self, limit: int) -> None:
        """The cap, swap off (v1: memsw is raised before, lowered after the memory limit,
        since it may never be below it)."""
        self.limit = limit
        if self.version == 2:
            self._write("memory.max", limit)
            self._write("memory.swap.max", 0)
            return
        current = int(self._read("memory.limit_in_bytes"))
        order = ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes") if limit > current \
            else ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        for name in order:
            self._write(name, limit)

    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        return next(int(line.split()[1]) for line in text.splitlines()
                    if line.startswith("oom_kill "))

    def empty(self) -> None:
        """Reclaim what the group holds with no process in it (the page cache its earlier
        processes read: the interpreter's and torch's files), so the next peak starts from
        nothing."""
        try:
            if self.version == 2:
                self._write("memory.reclaim", 2**40)
            else:
                self._write("memory.force_empty", 0)
        except OSError:
            pass   # memory.reclaim is there from Linux 5.19 on

    def reset_peak(self) -> None:
        try:
            self._write("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes", 0)
        except OSError:
            pass   # memory.peak is resettable from Linux 6.12 on

    def peak(self) -> int | None:
        try:
            return int(self._read("memory.peak" if self.version == 2
                                  else "memory.max_usage_in_bytes"))
        except OSError:
            return None


def run_capped(args: list[str], caps: list[MemoryCap], timeout: float, env: dict) -> dict:
    """`python <args>` started once per rank, rank r inside caps[r] (one group may hold
    several ranks), in environment `env` (the caller's, with what it adds) plus RANK,
    WORLD_SIZE and OMP_NUM_THREADS=1. Returns
    {"outcome": "fits", "oom" (a group's OOM-kill count rose), "timeout" or "error", "detail"
    (an error's first failed rank's last line), "seconds"}."""
    groups = list({id(c): c for c in caps}.values())
    before = [c.oom_kills() for c in groups]
    start = time.monotonic()
    procs = [subprocess.Popen(
        [sys.executable, *args],
        env={**env, "RANK": str(r), "WORLD_SIZE": str(len(caps)), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=cap.join)
        for r, cap in enumerate(caps)]
    outcome = "fits"
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() - start > timeout:
                outcome = "error" if failed else "timeout"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()   # a rank whose peer died waits in a collective
        errors = [p.communicate()[1] for p in procs]
    if any(c.oom_kills() > b for c, b in zip(groups, before)):
        outcome = "oom"
    elif outcome == "fits" and any(p.returncode for p in procs):
        outcome = "error"
    detail = next((e.strip().splitlines()[-1] for e in errors if e.strip()), "") \
        if outcome == "error" else ""
    return {"outcome": outcome, "detail": detail, "seconds": time.monotonic() - start}


def _own_memory_cgroup() -> tuple[int, str]:
    """(cgroup version, the directory of this process's memory cgroup)."""
    return _own_cgroup("memory", ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"),
                       ("/sys/fs/cgroup/memory",))


def _own_cgroup(controller: str, v2_roots: tuple[str, ...],
                v1_mounts: tuple[str, ...]) -> tuple[int, str]:
    """(cgroup version, the directory of this process's cgroup for `controller`): v2 where a
    root in `v2_roots` enables it (and this process's group delegates it), else v1 under the
    first of `v1_mounts` that exists."""
    with open("/proc/self/cgroup") as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f]
    for root in v2_roots:
        controllers = os.path.join(root, "cgroup.controllers")
        if os.path.exists(controllers) and controller in open(controllers).read().split():
            path = next(p for i, c, p in entries if i == "0")
            own = os.path.join(root, path.lstrip("/"))
            if controller not in open(os.path.join(own, "cgroup.subtree_control")).read() \
                    .split():
                raise OSError(f"cgroup v2: {own} does not delegate the {controller} controller")
            return 2, own
    for _, controllers, path in entries:
        if controller in controllers.split(","):
            for mount in v1_mounts:
                if os.path.isdir(mount):
                    return 1, os.path.join(mount, path.lstrip("/"))
    raise OSError(f"no {controller} cgroup controller is mounted")


class CpuQuota(_Group):
    """A CPU cgroup whose processes together get `cores` CPUs' worth of time (cgroup v2's
    cpu.max, or v1's cpu.cfs_quota_us over cpu.cfs_period_us): a host that is `cores` fast
    on one machine. `join(pid)` moves a whole process (every thread) into it. Needs root.

    The quota is enforced per period (`period_us`, the kernel's 100 ms by default): a process
    that spent its quarter of a period stops for the rest of it, where a device a quarter as
    fast would keep going slowly. A 10 ms period measured the same (docs/heterogeneous.md).
    """

    PERIOD_US = 100_000

    def __init__(self, cores: float, name: str = "quota", period_us: int = PERIOD_US):
        self.version, parent = _own_cpu_cgroup()
        self.path = os.path.join(parent, f"tilework-{name}-{os.getpid()}")
        os.mkdir(self.path)
        self.cores = cores
        quota = max(1000, int(cores * period_us))   # the kernel's floor: 1 ms
        try:
            if self.version == 2:
                self._write("cpu.max", f"{quota} {period_us}")
            else:
                self._write("cpu.cfs_period_us", period_us)
                self._write("cpu.cfs_quota_us", quota)
        except OSError:
            os.rmdir(self.path)
            raise


def _own_cpu_cgroup() -> tuple[int, str]:
    """(cgroup version, the directory of this process's cpu cgroup)."""
    return _own_cgroup("cpu", ("/sys/fs/cgroup",),
                       ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"))
