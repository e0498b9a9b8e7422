"""`tilework run`: start worker processes with torchrun semantics, on PyTorch's elastic launcher.

One host:     tilework run -n 4 train.py --lr 0.1
Several:      tilework run --hosts cluster.toml train.py       (the same command on every host)

Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR,
...). With a cluster file the c10d rendezvous runs on the file's rendezvous host, which every host
reaches at its address; this host is found by `--host NAME` or else by its hostname. The workers
run the script through `tilework.launch.script`, so that a failing script is reported in one line.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass

from ..cluster.topology import MAX_PROCS, Cluster
from ..errors import UserError


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

    from ..cluster.worker_env import TIMEOUT_ENV
    from .faults import LauncherLog, summarize

    # The elastic agent gives its workers a copy of this process's environment plus their own
    # RANK, WORLD_SIZE, ...: what they are to inherit is set here, in the launcher's own.
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does, so N workers do not each start a thread per core.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node))
    # Restarted workers must not share the rendezvous store with the attempt before them: they
    # would read its stale gloo/NCCL addresses and fail to connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if spec.timeout_s is not None:
        os.environ[TIMEOUT_ENV] = str(spec.timeout_s)  # each worker's WorkerEnv.timeout_s
    # c10d's C++ warnings print native stack traces when a peer's end goes away (the guard's
    # watcher polling a store whose host already exited: "recvValue failed", 20 frames), on
    # every rank, where tilework has one line for what happened. Errors still print; a user
    # sets TORCH_CPP_LOG_LEVEL=WARNING to see the warnings (docs/faults.md).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id, rdzv_backend=_register_rendezvous(), rdzv_endpoint=spec.rdzv_endpoint,
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


# -- the rendezvous: c10d, minus what a network outage turns into a hang or a lost restart -------

RDZV_BACKEND = "tilework-c10d"
# On the way out an agent tells the rendezvous host it is leaving. With that host unreachable the
# call blocks until the link returns (a TCPStore's own timeout does not fire while the peer is
# silent: measured), so the agent gives up after this long; the others notice anyway.
SHUTDOWN_WAIT_S = 5.0


def _register_rendezvous() -> str:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(RDZV_BACKEND, _create_rendezvous)  # idempotent
    return RDZV_BACKEND


def _create_rendezvous(params):
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    inner = rendezvous_handler_registry.create_handler(RendezvousParameters(
        "c10d", params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
        params.local_addr, **params.config))
    return _FixedSizeRendezvous(inner, params.endpoint)


class _FixedSizeRendezvous:
    """The c10d handler (torch's RendezvousHandler interface, by delegation) for a group whose
    size never changes (min_nodes == max_nodes).

    `num_nodes_waiting` is always 0: the agent asks it every monitor interval while its workers
    look healthy, and with the rendezvous host unreachable that call blocks until the link
    returns. Meanwhile the workers time out; when the call finally answers (another host waits to
    re-form), the agent restarts them as a membership change, which does not count as a restart:
    TORCHELASTIC_RESTART_COUNT stays 0 on this host alone, and its workers start afresh while the
    others resume (seen: one extra failed attempt per outage). A fixed-size group loses nothing
    by it: a host can only be waiting after one left, and that breaks the others' collectives,
    which restarts them the counted way.

    `shutdown` waits at most SHUTDOWN_WAIT_S (see there).
    """

    def __init__(self, inner, endpoint: str):
        self._inner, self._endpoint = inner, endpoint

    def get_backend(self) -> str:
        return RDZV_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self):
        return self._inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self):
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        outcome: list = []

        def close():
            try:
                outcome.append(self._inner.shutdown())
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                outcome.append(e)

        # A daemon: left blocked on an unreachable host, it must not hold up the exit.
        t = threading.Thread(target=close, name="tilework-rdzv-shutdown", daemon=True)
        t.start()
        t.join(SHUTDOWN_WAIT_S)
        if not outcome:
            print(f"tilework run: the rendezvous host {self._endpoint} did not answer within "
                  f"{SHUTDOWN_WAIT_S:g} s on the way out (that host or the network is down)",
                  file=sys.stderr)
            return False
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return bool(outcome[0])
