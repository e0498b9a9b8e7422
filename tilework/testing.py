"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

    results = spawn(fn, world_size=4, args=(x,))   # fn(rank, world_size, *args) in every rank

The first rank to fail is re-raised here as `RankFailed` with its rank and traceback; the other
ranks are killed at once, so a rank stuck in a collective its failed peer never joins cannot hang
the caller. Every rank is killed after `timeout` seconds. Rendezvous goes through a TCPStore that
this process owns on a port the OS picked, so concurrent runs never race for a port.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from .launch.faults import yield_to_the_guards_verdict


class RankFailed(RuntimeError):
    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed:\n{detail}")


def _child(fn, rank, world_size, port, args, results, timeout, backend):
    try:
        torch.set_num_threads(1)
        if backend == "nccl":  # one GPU per rank, as torchrun's LOCAL_RANK would give
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # This child is a worker's entry point: code under test that joins the world on its own
        # (parallelize without groups) reads its WorkerEnv from here, as under a launcher.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        dist.destroy_process_group()
        # As bytes: a tensor put on the queue directly travels as a shared-memory handle that
        # dies with this process.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        # As under a launcher: a peer that left on the call guard's verdict is not this rank's
        # failure to report; the verdict (exit code 2) ends this process too.
        yield_to_the_guards_verdict()
        results.put((rank, "error", traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 60.0,
          start_method: str = "forkserver", backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks of a `backend` world (gloo; nccl
    on CUDA, rank r on GPU r); return results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Fork from a single-threaded server that imported torch once: fast starts, and no child
        # inherits a lock held by one of this process's threads (the store's, the queue's).
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    master = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                           wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, daemon=True,
                    args=(fn, r, world_size, master.port, args, results, timeout, backend))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None and p.exitcode != 0:
                        raise RankFailed(r, f"process exited with code {p.exitcode} "
                                            "before reporting (killed or crashed)")
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in out]
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
                continue
            if status == "error":
                raise RankFailed(rank, value)
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        del master
    return [out[r] for r in range(world_size)]


def spawn_on_cpu_quotas(fn: Callable[..., Any], cores: list[float], args: tuple = (),
                        timeout: float = 60.0) -> list[Any]:
    """`spawn(fn, len(cores), (quota_paths, *args))` with a CPU cgroup of `cores[r]` cores made
    for each rank (tilework/bench/cgroup.CpuQuota), which `fn` joins by writing its pid to
    `quota_paths[rank]/cgroup.procs`; the cgroups removed after. The test is skipped where
    that needs root or no cgroup exists."""
    import pytest

    from .bench.cgroup import CpuQuota

    if os.geteuid() != 0:
        pytest.skip("a rank's CPU quota needs root")
    quotas = []
    try:
        for r, share in enumerate(cores):
            quotas.append(CpuQuota(share, name=f"rank{r}"))
    except OSError as e:
        for q in quotas:
            q.remove()
        pytest.skip(f"no cpu cgroup here: {e}")
    try:
        return spawn(fn, len(cores), args=([q.path for q in quotas], *args), timeout=timeout)
    finally:
        for q in quotas:
            q.remove()
