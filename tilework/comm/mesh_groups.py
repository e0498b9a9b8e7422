"""The process groups of a parallel mesh (dp x pp x cp x tp), built once and passed down.

`new_group` is collective over the world: every rank creates every group of every axis, in one
order (axes in mesh order, groups in `Mesh.groups` order), and keeps the ones it belongs to.
Nothing here reads a global group: whatever communicates receives a `MeshGroups` (or one of its
groups) as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..cluster.mesh import Mesh
from ..cluster.topology import Topology
from ..cluster.worker_env import WorkerEnv
from ..errors import PlanError
from .groups import Groups, _timeout_of


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
