"""The device mesh: ranks as a grid of named axes, and which ranks form a group along an axis.

Pure (like Megatron's RankGenerator): ranks are numbered row-major, the last axis fastest, so
today's mesh ("host", H) x ("local", L) numbers ranks host by host, as torchrun does. A group
along an axis is the ranks that differ only in that axis: along "local", one host's ranks;
along "host", the ranks sharing a local index on every host. Axes a later plan adds (data,
tensor, pipeline, context parallel) are more names in the same tuple.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import prod

from ..errors import PlanError


@dataclass(frozen=True)
class Mesh:
    axes: tuple[tuple[str, int], ...]

    def __post_init__(self):
        names = [name for name, _ in self.axes]
        if not self.axes:
            raise ValueError("a mesh needs at least one axis")
        for name, size in self.axes:
            if not (isinstance(name, str) and name.isidentifier()):
                raise ValueError(f"mesh axis name must be an identifier, got {name!r}")
            if not (isinstance(size, int) and size >= 1):
                raise ValueError(f"mesh axis {name!r}: size must be an integer >= 1, got {size!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be distinct, got {names}")

    @classmethod
    def from_topology(cls, topology) -> "Mesh":
        """host x local where every host runs as many ranks; one "world" axis otherwise (hosts
        of different sizes are not a grid: the topology still says which ranks share one)."""
        sizes = {len(h) for h in topology.hosts}
        if len(sizes) == 1:
            return cls((("host", topology.num_hosts), ("local", sizes.pop())))
        return cls((("world", topology.world_size),))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        return prod(self.shape)

    def size_of(self, axis: str) -> int:
        return self.shape[self._index(axis)]

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.size} ranks")
        out = {}
        for name, size in reversed(self.axes):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.names}

    def rank_of(self, coords: dict[str, int]) -> int:
        if set(coords) != set(self.names):
            raise ValueError(f"coordinates must name every axis {list(self.names)}, "
                             f"got {sorted(coords)}")
        rank = 0
        for name, size in self.axes:
            if not 0 <= coords[name] < size:
                raise ValueError(f"coordinate {name}={coords[name]} outside 0..{size - 1}")
            rank = rank * size + coords[name]
        return rank

    def groups(self, axis: str | tuple[str, ...]) -> list[tuple[int, ...]]:
        """Every group along `axis` (or along several axes: the ranks that differ only in
        those), each in increasing rank, ordered by their first rank."""
        return list(_groups(self, (axis,) if isinstance(axis, str) else tuple(axis)))

    def as_dict(self) -> dict:
        return {"axes": [{"name": n, "size": s} for n, s in self.axes]}

    @classmethod
    def from_dict(cls, d: dict) -> "Mesh":
        return cls(tuple((a["name"], a["size"]) for a in d["axes"]))

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.axes)

    def _index(self, axis: str) -> int:
        if axis not in self.names:
            raise ValueError(f"no mesh axis {axis!r} (axes: {', '.join(self.names)})")
        return self.names.index(axis)


@functools.lru_cache(maxsize=1024)
def _groups(mesh: Mesh, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Mesh.groups, once per mesh and axes: a mesh search asks for the same few thousands of
    times."""
    for a in axes:
        mesh._index(a)
    out: dict[tuple, list[int]] = {}
    for r in range(mesh.size):
        at = mesh.coords(r)
        out.setdefault(tuple(v for k, v in at.items() if k not in axes), []).append(r)
    return tuple(sorted(tuple(g) for g in out.values()))


PARALLEL_AXES = ("dp", "pp", "cp", "tp")


def parallel_mesh(world_size: int, ranks_per_host: int | None = None, tp: int = 1, pp: int = 1,
                  cp: int = 1) -> Mesh:
    """dp x pp x cp x tp over `world_size` ranks, dp what the others leave.

    tp varies fastest, so a tensor-parallel group is consecutive ranks: inside one host when tp
    divides `ranks_per_host` (torchrun numbers ranks host by host). Tensor parallelism talks
    in every layer, forward and backward; data parallelism once a step, so dp is the axis that
    crosses hosts (Megatron-LM's rule). Where tp cannot stay inside a host this says so.
    """
    for name, size in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not (isinstance(size, int) and size >= 1):
            raise PlanError(f"{name} must be an integer >= 1, got {size!r}")
    inner = tp * pp * cp
    if world_size % inner:
        raise PlanError(f"tp x pp x cp = {tp} x {pp} x {cp} = {inner} does not divide the "
                         f"world of {world_size} ranks")
    if ranks_per_host is not None:
        if not (isinstance(ranks_per_host, int) and ranks_per_host >= 1):
            raise PlanError(f"ranks_per_host must be an integer >= 1, got {ranks_per_host!r}")
        if ranks_per_host % tp and tp % ranks_per_host:
            raise PlanError(f"tp={tp} and {ranks_per_host} ranks per host: a tensor-parallel "
                             "group would straddle hosts; choose a tp that divides "
                             f"{ranks_per_host} (or a multiple of it, whole hosts per group)")
    return Mesh((("dp", world_size // inner), ("pp", pp), ("cp", cp), ("tp", tp)))


def least_by(mesh: Mesh, axis: str, values) -> list:
    """The least of `values` (one per rank of `mesh`) at each coordinate of `axis`: a pipeline
    rank's or a replica's slowest speed, or its smallest memory."""
    return [min(values[r] for r in range(mesh.size) if mesh.coords(r)[axis] == i)
            for i in range(mesh.size_of(axis))]


def pp_speeds(mesh: Mesh, cluster, pp: int) -> list[float] | None:
    """Each pipeline rank's speed on `cluster` (the slowest of the ranks at that pp
    coordinate), where the cluster's hosts differ in speed; None where they do not, or
    without a pipeline."""
    if pp == 1 or cluster is None or not cluster.heterogeneous \
            or cluster.world_size != mesh.size:
        return None
    return least_by(mesh, "pp", cluster.speeds())


def pp_memory(mesh: Mesh, cluster, pp: int) -> list[float] | None:
    """Each pipeline rank's memory on `cluster` (the least `memory_gb` of the ranks at that pp
    coordinate), where every host gives one and they differ across the pp coordinates; None
    otherwise, or without a pipeline."""
    if pp == 1 or cluster is None or cluster.world_size != mesh.size \
            or any(h.memory_gb is None for h in cluster.hosts):
        return None
    least = least_by(mesh, "pp", cluster.memories())
    return least if len(set(least)) > 1 else None
