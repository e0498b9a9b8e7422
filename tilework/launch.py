"""`tilework run`: start worker processes with torchrun semantics, on PyTorch's elastic launcher.

One host:     tilework run -n 4 train.py --lr 0.1
Several:      tilework run --hosts cluster.toml train.py       (the same command on every host)

Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR,
...). With a cluster file the c10d rendezvous runs on the file's rendezvous host, which every host
reaches at its address; this host is found by `--host NAME` or else by its hostname.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from dataclasses import dataclass

from .cluster import MAX_PROCS, Cluster
from .errors import UserError


@dataclass(frozen=True)
class LaunchSpec:
    """What to start on this host: a pure description, built and checked before anything runs."""

    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    is_rendezvous_host: bool
    run_id: str
    local_addr: str | None
    max_restarts: int
    timeout_s: float | None = None   # collective timeout in the workers (None: their default)


def local_spec(nproc: int, max_restarts: int = 0, timeout_s: float | None = None) -> LaunchSpec:
    if not 1 <= nproc <= MAX_PROCS:
        raise UserError(f"-n/--nproc: expected 1 to {MAX_PROCS} processes, got {nproc}")
    return LaunchSpec(nnodes=1, nproc_per_node=nproc, rdzv_endpoint="127.0.0.1:0",
                      is_rendezvous_host=True, run_id=str(uuid.uuid4()), local_addr=None,
                      max_restarts=_restarts(max_restarts), timeout_s=_timeout(timeout_s))


def cluster_spec(cluster: Cluster, this_host: str | None = None, run_id: str = "tilework",
                 max_restarts: int = 0, timeout_s: float | None = None) -> LaunchSpec:
    index = cluster.host_index(this_host or socket.gethostname())
    host = cluster.hosts[index]
    return LaunchSpec(nnodes=len(cluster.hosts), nproc_per_node=host.procs,
                      rdzv_endpoint=cluster.rendezvous_endpoint,
                      is_rendezvous_host=cluster.rendezvous_host == index,
                      run_id=run_id, local_addr=host.address, max_restarts=_restarts(max_restarts),
                      timeout_s=_timeout(timeout_s))


def _restarts(n: int) -> int:
    if n < 0:
        raise UserError(f"--max-restarts: expected 0 or more, got {n}")
    return n


def _timeout(seconds: float | None) -> float | None:
    if seconds is not None and not (0 < seconds < float("inf")):
        raise UserError(f"--timeout: expected a positive number of seconds, got {seconds}")
    return seconds


def run(spec: LaunchSpec, python_args: list[str], verbose: bool = False) -> int:
    """Run `python <python_args>` in every local worker; 0 when all succeeded, else 1 with the
    failed ranks named, the cause first (see faults.summarize)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .comm.groups import TIMEOUT_ENV
    from .faults import LauncherLog, summarize

    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does, so N workers do not each start a thread per core.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node))
    # Restarted workers must not share the rendezvous store with the attempt before them: they
    # would read its stale gloo/NCCL addresses and fail to connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if spec.timeout_s is not None:
        os.environ[TIMEOUT_ENV] = str(spec.timeout_s)  # workers inherit it; init_from_env reads it
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id, rdzv_backend="c10d", rdzv_endpoint=spec.rdzv_endpoint,
        rdzv_configs={"is_host": spec.is_rendezvous_host}, max_restarts=spec.max_restarts,
        monitor_interval=0.5, start_method="spawn", local_addr=spec.local_addr,
    )
    log = LauncherLog(verbose=verbose)
    log.install()
    try:
        elastic_launch(config, sys.executable)("-u", *python_args)
    except ChildFailedError as e:
        failures = {rank: (f.exitcode, f.message if isinstance(f.message, str)
                           else str(f.message.get("message", "")))
                    for rank, f in e.failures.items()}
        for line in summarize(failures):
            print(f"tilework run: {line}", file=sys.stderr)
        return 1
    except RendezvousError as e:
        print(f"tilework run: the hosts could not meet at {spec.rdzv_endpoint}: "
              f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
              file=sys.stderr)
        return 1
    finally:
        log.uninstall()
    return 0
