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

from .cluster import Cluster
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


def local_spec(nproc: int, max_restarts: int = 0) -> LaunchSpec:
    if nproc < 1:
        raise UserError(f"-n/--nproc: expected at least 1 process, got {nproc}")
    return LaunchSpec(nnodes=1, nproc_per_node=nproc, rdzv_endpoint="127.0.0.1:0",
                      is_rendezvous_host=True, run_id=str(uuid.uuid4()), local_addr=None,
                      max_restarts=_restarts(max_restarts))


def cluster_spec(cluster: Cluster, this_host: str | None = None, run_id: str = "tilework",
                 max_restarts: int = 0) -> LaunchSpec:
    index = cluster.host_index(this_host or socket.gethostname())
    host = cluster.hosts[index]
    return LaunchSpec(nnodes=len(cluster.hosts), nproc_per_node=host.procs,
                      rdzv_endpoint=cluster.rendezvous_endpoint,
                      is_rendezvous_host=cluster.rendezvous_host == index,
                      run_id=run_id, local_addr=host.address, max_restarts=_restarts(max_restarts))


def _restarts(n: int) -> int:
    if n < 0:
        raise UserError(f"--max-restarts: expected 0 or more, got {n}")
    return n


def run(spec: LaunchSpec, python_args: list[str]) -> int:
    """Run `python <python_args>` in every local worker; 0 when all succeeded, else 1 with the
    failed ranks named."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does, so N workers do not each start a thread per core.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node))
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id, rdzv_backend="c10d", rdzv_endpoint=spec.rdzv_endpoint,
        rdzv_configs={"is_host": spec.is_rendezvous_host}, max_restarts=spec.max_restarts,
        monitor_interval=0.5, start_method="spawn", local_addr=spec.local_addr,
    )
    try:
        elastic_launch(config, sys.executable)("-u", *python_args)
    except ChildFailedError as e:
        failed = sorted(e.failures.items())
        ranks = ", ".join(f"rank {rank} (exit code {f.exitcode})" for rank, f in failed)
        print(f"tilework run: {ranks} failed; the others were stopped", file=sys.stderr)
        for rank, f in failed:
            message = f.message if isinstance(f.message, str) else f.message.get("message", "")
            if message:
                print(f"  rank {rank}: {str(message).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    return 0
