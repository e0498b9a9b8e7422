"""Process groups: the world, each host's ranks (intra) and the same local rank across hosts
(inter); on a parallel mesh (dp x pp x cp x tp), each axis's groups (`MeshGroups`) and the
data-parallel `Groups` of a rank's dp group.

Built once, then passed explicitly to whatever communicates; nothing below reads a global group.
`new_group` is collective over the world: every rank must call `build_groups` with the same
topology, and every rank creates every group of every mesh axis, in one order (axes in mesh
order, groups in `Mesh.groups` order), keeping the ones it belongs to. What the launcher said
about this rank arrives as a `WorkerEnv`, read by the entry point.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..cluster.mesh import Mesh
from ..cluster.topology import Topology
from ..cluster.worker_env import WorkerEnv
from ..errors import PlanError


@dataclass(frozen=True)
class Groups:
    """The groups one rank belongs to. `intra` and `inter` are None where they would be trivial."""

    world: dist.ProcessGroup
    topology: Topology
    rank: int
    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None
    device: torch.device
    store: object = None  # the world's key-value store: a side channel for the call guard
    env: WorkerEnv = WorkerEnv()  # what the launcher said: the timeout, where failures go

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def host(self) -> int:
        return self.topology.host_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank(self.rank)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(timeout_s: float | None = None,
                  env: WorkerEnv | None = None) -> dist.ProcessGroup:
    """Join the world that torchrun (or `tilework run`) described in the environment.

    tilework's entry points pass the `env` they read; a user's script calls this bare, as its
    own entry point into tilework, and the environment is read here. Either way torch's
    init_method env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT once more itself.
    """
    env = env if env is not None else WorkerEnv.from_environ()
    if not dist.is_initialized():
        device = local_device(env.local_rank)
        dist.init_process_group(
            backend=default_backend(device),
            timeout=datetime.timedelta(seconds=timeout_s or env.collective_timeout_s),
        )
    return dist.group.WORLD


def local_device(local_rank: int = 0) -> torch.device:
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def discover_topology(world: dist.ProcessGroup, group_rank: int | None = None) -> Topology:
    """Ask every rank which host it is on (torchrun's GROUP_RANK, else the hostname)."""
    import socket

    me = str(group_rank) if group_rank is not None else socket.gethostname()
    hosts: list[object] = [None] * dist.get_world_size(world)
    dist.all_gather_object(hosts, me, group=world)
    return Topology.from_host_ids(hosts)


def live_topology(env: WorkerEnv) -> Topology | None:
    """The world this process is a rank of, without a collective: inside an initialised
    process group, its size, its hosts of torchrun's LOCAL_WORLD_SIZE ranks each (one host
    where that does not divide it); None outside one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    per_host = env.local_world_size if env.launched else world
    if world % per_host:
        per_host = world
    return Topology.uniform(world // per_host, per_host)


def solo() -> Groups:
    """A world of one process, with no process group at all (every collective short-circuits)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    return Groups(world=None, topology=Topology.from_sizes([1]), rank=0, intra=None, inter=None,
                  device=device)


def build_groups(world: dist.ProcessGroup | None = None, topology: Topology | None = None,
                 env: WorkerEnv | None = None) -> Groups:
    """Create the intra- and inter-host groups for `topology` (discovered when not given).

    `env` as for `init_from_env`: tilework's entry points pass theirs, a user's script none.
    """
    if world is None and not dist.is_initialized():
        return solo()
    env = env if env is not None else WorkerEnv.from_environ()
    world = world or dist.group.WORLD
    topology = topology or discover_topology(world, env.group_rank)
    rank = dist.get_rank(world)
    if topology.world_size != dist.get_world_size(world):
        raise ValueError(
            f"topology has {topology.world_size} ranks but the world has "
            f"{dist.get_world_size(world)}"
        )
    backend = dist.get_backend(world)
    # new_group's own default is 30 minutes, whatever the world was given: without this a rank
    # whose peer host went silent would wait half an hour in a host or cross-host group.
    timeout = _timeout_of(world, backend, env)
    intra = inter = None
    if topology.num_hosts == 1:
        intra = world if topology.world_size > 1 else None
    elif all(len(h) == 1 for h in topology.hosts):
        inter = world
    else:
        # new_group is collective over the world: every rank creates every group, in one order.
        for ranks in topology.hosts:
            g = dist.new_group(list(ranks), backend=backend, timeout=timeout) \
                if len(ranks) > 1 else None
            if rank in ranks:
                intra = g
        for ranks in topology.inter_host_groups():
            g = dist.new_group(list(ranks), backend=backend, timeout=timeout) \
                if len(ranks) > 1 else None
            if rank in ranks:
                inter = g
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
              else torch.device("cpu"))
    return Groups(world=world, topology=topology, rank=rank, intra=intra, inter=inter,
                  device=device, store=_store_of(world), env=env)


def push_group(groups: Groups) -> dist.ProcessGroup:
    """A second gloo group over the world's ranks for the servers' push (collective: every rank
    calls it, in the same order). The push's all-to-all and a forward's pull are then never
    paired: under gloo a pull on one rank met by the push of another (the forward run on one
    rank only, to evaluate) aborted the process on a size mismatch before the call guard could
    name it; on two groups both wait, and the guard says which calls disagree. The world itself
    where another group cannot be made safely: a world that is not the default group (new_group
    is collective over the default one), or NCCL (a communicator's memory for no such abort).
    Every rank makes (or finds) it at the same call, so the collective stays in step."""
    world = groups.world
    if groups.world_size == 1 or world is None or world is not dist.group.WORLD \
            or dist.get_backend(world) != "gloo":
        return world
    # One twin per world, however many models are parallelized in the process (a gloo group
    # holds threads and sockets until the world is destroyed). Keyed by the world itself, held,
    # so a world made after this one was destroyed gets a twin of its own.
    held = _twins.get(id(world))
    if held is None or held[0] is not world:
        held = _twins[id(world)] = (world, dist.new_group(
            list(range(groups.world_size)), backend="gloo",
            timeout=_timeout_of(world, "gloo", groups.env)))
    return held[1]


_twins: dict[int, tuple] = {}


def _store_of(world: dist.ProcessGroup):
    """The default group's store (TCPStore behind a prefix), where the world is that group."""
    if world is not dist.group.WORLD:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # private API: the guard is then off
        return None


def _timeout_of(world: dist.ProcessGroup, backend: str, env: WorkerEnv) -> datetime.timedelta:
    """The collective timeout `world` was created with (else `--timeout`'s)."""
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    try:
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # private API: fall back to what init_from_env uses
        return datetime.timedelta(seconds=env.collective_timeout_s)


def exit_worker(code: int = 0) -> None:
    """Leave a worker process: destroy the process group, flush, and exit at once.

    A normal exit can abort ("terminate called without an active exception", SIGABRT), which
    the launcher reports as a failed rank. Read from the cores (torch 2.13, gloo; docs/faults.md):
    a gloo worker thread still holds the last collective's work after `wait()` returned, and
    when it lets go of it the tensor inside (freed by Python meanwhile) needs the GIL; if the
    interpreter is finalizing by then, CPython ends the thread with pthread_exit, and the
    forced unwind through C++ frames aborts. `destroy_process_group` does not join those
    threads while anything (a model, an engine) still holds the group. Skipping interpreter
    teardown avoids the race; it cannot be closed from Python otherwise.
    """
    import sys

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass(frozen=True, eq=False)
class MeshGroups:
    """One rank's groups along each mesh axis (None where the axis has size 1)."""

    mesh: Mesh
    rank: int
    groups: dict

    def group(self, axis: str):
        self.mesh.size_of(axis)   # an unknown axis is named in the error
        return self.groups[axis]

    def size(self, axis: str) -> int:
        return self.mesh.size_of(axis)

    def coord(self, axis: str) -> int:
        return self.mesh.coords(self.rank)[axis]

    def ranks(self, axis: str) -> tuple[int, ...]:
        """The global ranks of this rank's group along `axis`, in group-rank order."""
        return next(g for g in self.mesh.groups(axis) if self.rank in g)


def build_mesh_groups(mesh: Mesh, world=None, env: WorkerEnv | None = None) -> MeshGroups:
    """Create every group of every axis of `mesh`; every rank of the world must call this.

    An axis spanning the whole world reuses the world group itself; size-1 groups are None
    (every counted collective short-circuits on them).
    """
    if world is None and not dist.is_initialized():
        if mesh.size != 1:
            raise PlanError(f"a mesh of {mesh.size} ranks needs an initialised process group")
        return MeshGroups(mesh, 0, {axis: None for axis in mesh.names})
    world = world or dist.group.WORLD
    if dist.get_world_size(world) != mesh.size:
        raise PlanError(f"the mesh {mesh} has {mesh.size} ranks but the world has "
                         f"{dist.get_world_size(world)}")
    rank = dist.get_rank(world)
    backend = dist.get_backend(world)
    # new_group's own default timeout is 30 minutes, whatever the world was given.
    timeout = _timeout_of(world, backend, env if env is not None else WorkerEnv())
    mine = {}
    for axis in mesh.names:
        mine[axis] = None
        for ranks in mesh.groups(axis):
            if len(ranks) == 1:
                continue
            if len(ranks) == mesh.size:
                group = world
            else:
                group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            if rank in ranks:
                mine[axis] = group
    return MeshGroups(mesh, rank, mine)


def data_parallel_groups(mesh_groups: MeshGroups, world_groups: Groups,
                         axes: tuple[str, ...] = ("dp",)) -> Groups:
    """The data-parallel engine's `Groups` over this rank's group along `axes` (dp; dp and cp
    under context parallelism, whose ranks' gradients are averaged together as Megatron's
    dp-cp group does): its own topology (which of its ranks share a host), host and
    cross-host groups, and the world's store under a prefix of its own, since every such group
    runs its own call guard.

    Collective over the world: every rank creates the groups of every such group, in mesh order.
    """
    mesh, world = mesh_groups.mesh, world_groups.world
    if mesh.size == 1 or world is None:
        return world_groups
    backend = dist.get_backend(world)
    timeout = _timeout_of(world, backend, world_groups.env)
    me, mine = world_groups.rank, None
    for index, ranks in enumerate(mesh.groups(axes)):
        if axes == ("dp",):
            group = mesh_groups.group("dp") if me in ranks else None
        elif len(ranks) == mesh.size:
            group = world
        else:
            made = dist.new_group(list(ranks), backend=backend, timeout=timeout) \
                if len(ranks) > 1 else None
            group = made if me in ranks else None
        topology = Topology.from_host_ids([world_groups.topology.host_of(r) for r in ranks])
        intra, inter = _host_groups(ranks, topology, group, backend, timeout, me)
        if me in ranks:
            store = world_groups.store
            if store is not None and group is not None:
                store = dist.PrefixStore(f"tilework/dp{index}/", store)
            mine = Groups(world=group, topology=topology, rank=ranks.index(me), intra=intra,
                          inter=inter, device=world_groups.device,
                          store=store if group is not None else None, env=world_groups.env)
    return mine


def _host_groups(ranks: tuple[int, ...], topology: Topology, dp_group, backend, timeout,
                 me: int):
    """As comm.groups.build_groups does for the world, over the dp group `ranks` (global ranks;
    `topology` in the group's own numbering); `dp_group` where this rank is in it."""
    if len(ranks) == 1:
        return None, None
    if topology.num_hosts == 1:
        return dp_group, None
    if all(len(h) == 1 for h in topology.hosts):
        return None, dp_group
    made = {}
    for kind, lists in (("intra", topology.hosts), ("inter", topology.inter_host_groups())):
        made[kind] = None
        for members in lists:
            glob = [ranks[i] for i in members]
            g = dist.new_group(glob, backend=backend, timeout=timeout) if len(glob) > 1 else None
            if me in glob:
                made[kind] = g
    return made["intra"], made["inter"]
