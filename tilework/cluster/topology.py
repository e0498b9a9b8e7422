"""The cluster: hosts, processes per host, links; Parallax's "resource info" file.

A cluster file (TOML) looks like:

    rendezvous = "node0:29500"        # host name (or address) and port of the rendezvous
    [[hosts]]
    name = "node0"
    address = "192.0.2.1"             # optional; what other hosts use to reach this one
    procs = 2                         # processes (ranks) on this host
    memory_gb = 80                    # optional: memory per process, for `tilework plan`
    speed = 1.0                       # optional: each process's compute, relative to others'
    [[hosts]]
    name = "node1"
    procs = 2
    [links.intra]                     # optional: between ranks of one host
    bandwidth_gbps = 100.0
    latency_us = 5.0
    [links.inter]                     # optional: between hosts
    bandwidth_gbps = 10.0
    latency_us = 50.0
    reduce_scatter_factor = 1.0       # optional: ZeRO's exchanges against the fit (calibrate)
    all_gather_factor = 1.0
    ring_shift_factor = 1.0           # optional: ring attention's shift against it

`Topology` is the pure rank-to-host map every later layer (groups, planner, cost model) reads.
Ranks are numbered host by host, as torchrun's agents number them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import files as config
from ..config.files import check
from ..errors import ConfigError

MAX_PROCS = 1024  # per host: far beyond any host's accelerators or cores


@dataclass(frozen=True)
class Link:
    """A link class: alpha (latency) and beta (bandwidth) of the alpha-beta cost model, fitted
    to all-reduces; and how much longer than that fit prices their bytes ZeRO's two exchanges
    take as the runtime makes them (comm/counted.py: on gloo the reduce-scatter is an
    all-to-all and a local sum). Measured by `tilework calibrate`, 1 where not: on 2 emulated
    hosts at 1 Gbit/s gloo's all-to-all took 1.7-2.0x and its all-gather 1.4-1.6x, a
    simultaneous exchange both ways through the shaped queues, where the ring all-reduce's
    chunks kept both directions full. Likewise `ring_shift_factor`: ring attention's shift
    (every rank sends to the next while it receives from the previous) against the fit's
    price of its bytes.

    The meetings of small calls differ by collective too: gloo's all-to-all posts its n - 1
    sends at once and waits once, its all-gather is a ring of n - 1 waits one after another.
    `all_to_all_latency_factor` and `all_gather_latency_factor`: a small call's measured time
    over what the fit's latency charges its messages (on 4 emulated hosts: an all-to-all 0.67,
    an all-gather 1.25; the servers' exchange, three all-to-alls, had been priced as if it
    waited as long as the all-gather's three rings)."""

    bandwidth_gbps: float = 10.0
    latency_us: float = 50.0
    reduce_scatter_factor: float = 1.0
    all_gather_factor: float = 1.0
    ring_shift_factor: float = 1.0
    all_to_all_latency_factor: float = 1.0
    all_gather_latency_factor: float = 1.0

    def __post_init__(self):
        check(self.bandwidth_gbps > 0, "bandwidth_gbps", "a positive number of Gbit/s")
        check(self.latency_us >= 0, "latency_us", "a latency >= 0 microseconds")
        for name in ("reduce_scatter_factor", "all_gather_factor", "ring_shift_factor",
                     "all_to_all_latency_factor", "all_gather_latency_factor"):
            check(getattr(self, name) > 0, name, "a positive factor (1: as the all-reduce fit "
                                                 "prices its bytes)")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class Links:
    intra: Link = field(default_factory=lambda: Link(bandwidth_gbps=100.0, latency_us=5.0))
    inter: Link = field(default_factory=Link)

    def crossed(self, *groups_hosts) -> Link:
        """The one link rule: the slowest link a collective crosses, given the hosts of each of
        its groups' ranks (one collection per group that runs it at once): the inter-host
        link if any group spans two hosts, else the intra-host one."""
        spans = any(len(set(hosts)) > 1 for hosts in groups_hosts)
        return self.inter if spans else self.intra


@dataclass(frozen=True)
class Host:
    name: str
    procs: int = 1
    address: str | None = None
    memory_gb: float | None = None    # memory for each process (a GPU's, or host RAM / procs)
    speed: float = 1.0                # each process's compute, relative to the others'

    def __post_init__(self):
        check(bool(self.name.strip()), "name", "a non-empty host name")
        check(isinstance(self.speed, (int, float)) and not isinstance(self.speed, bool)
              and 0 < self.speed < float("inf"), "speed",
              f"a positive relative speed (1.0: as fast as a reference process), got "
              f"{self.speed!r}")
        check(self.memory_gb is None or self.memory_gb > 0, "memory_gb",
              f"a positive number of GB per process, got {self.memory_gb}")
        check(self.procs >= 1, "procs", f"at least 1 process per host, got {self.procs}")
        # Every layer lists a host's ranks (Topology); a typo like 2**40 must not try to.
        check(self.procs <= MAX_PROCS, "procs",
              f"at most {MAX_PROCS} processes per host, got {self.procs}")

    @property
    def reach(self) -> str:
        return self.address or self.name


@dataclass(frozen=True)
class Cluster:
    hosts: list[Host]
    rendezvous: str | None = None
    links: Links = field(default_factory=Links)

    def __post_init__(self):
        check(len(self.hosts) >= 1, "hosts", "at least one [[hosts]] entry")
        seen: set[str] = set()
        for i, h in enumerate(self.hosts):
            if h.name in seen:
                raise ConfigError(f"hosts[{i}].name", f"duplicate host {h.name!r}")
            seen.add(h.name)
        if self.rendezvous is not None:
            host, _, port = self.rendezvous.rpartition(":")
            # ASCII and short: str.isdigit() also takes "²", which int() refuses, and int()
            # refuses more than 4,300 digits.
            digits = port.isascii() and port.isdigit() and len(port) <= 5
            check(bool(host) and digits and 0 < int(port) < 65536,
                  "rendezvous", f"'host:port' with a port in 1..65535, got {self.rendezvous!r}")
            check(self.rendezvous_host is not None, "rendezvous",
                  f"the name or address of one of the hosts, got {host!r}")

    @classmethod
    def load(cls, path: str | Path) -> "Cluster":
        return config.load(cls, path)

    @classmethod
    def local(cls, procs: int, name: str = "localhost") -> "Cluster":
        return cls(hosts=[Host(name=name, procs=procs)])

    @classmethod
    def of_topology(cls, topology: "Topology", links: Links | None = None,
                    memory_gb: list[float | None] | None = None,
                    speeds: list[float] | None = None) -> "Cluster":
        """The ranks as discovered (host i named "host{i}"), on `links` (default: the
        defaults), host i with `memory_gb[i]` per process and `speeds[i]` where given."""
        memory, speed = list(memory_gb or []), list(speeds or [])
        return cls(hosts=[Host(f"host{i}", len(ranks),
                               memory_gb=memory[i] if i < len(memory) else None,
                               speed=speed[i] if i < len(speed) else 1.0)
                          for i, ranks in enumerate(topology.hosts)],
                   links=links if links is not None else Links())

    @property
    def world_size(self) -> int:
        return sum(h.procs for h in self.hosts)

    @property
    def rendezvous_endpoint(self) -> str:
        """host:port; defaults to the first host on torchrun's default port."""
        if self.rendezvous is None:
            return f"{self.hosts[0].reach}:29500"
        host, _, port = self.rendezvous.rpartition(":")
        by_name = {h.name: h for h in self.hosts}
        return f"{by_name[host].reach if host in by_name else host}:{port}"

    @property
    def rendezvous_host(self) -> int | None:
        """Index of the host that runs the rendezvous (None: a host not in the list)."""
        if self.rendezvous is None:
            return 0
        name = self.rendezvous.rpartition(":")[0]
        for i, h in enumerate(self.hosts):
            if name == h.name:
                return i
        for i, h in enumerate(self.hosts):
            if name == h.address:
                return i
        return None

    def host_index(self, name: str) -> int:
        for i, h in enumerate(self.hosts):
            if name in (h.name, h.address):
                return i
        names = ", ".join(h.name for h in self.hosts)
        raise ConfigError("hosts",
                          f"this host {name!r} is not in the cluster file (hosts: {names})")

    def topology(self) -> "Topology":
        return Topology.from_sizes([h.procs for h in self.hosts])

    @property
    def procs_per_host(self) -> int | None:
        """The ranks on each host where every host has as many, else None (what a mesh's
        placement of tp inside a host needs: cluster/mesh.parallel_mesh)."""
        sizes = {h.procs for h in self.hosts}
        return next(iter(sizes)) if len(sizes) == 1 else None

    def speeds(self) -> list[float]:
        """Every rank's relative speed, rank order (host by host)."""
        return [h.speed for h in self.hosts for _ in range(h.procs)]

    def memories(self) -> list[float | None]:
        """Every rank's `memory_gb` (None where its host gives none), rank order."""
        return [h.memory_gb for h in self.hosts for _ in range(h.procs)]

    @property
    def heterogeneous(self) -> bool:
        return len({h.speed for h in self.hosts}) > 1


@dataclass(frozen=True)
class Topology:
    """Which ranks share a host. `hosts[i]` lists the global ranks on host i, in order."""

    hosts: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        flat = [r for h in self.hosts for r in h]
        if sorted(flat) != list(range(len(flat))) or any(len(h) == 0 for h in self.hosts):
            raise ValueError(f"topology must cover ranks 0..n-1 once each, got {self.hosts}")

    @classmethod
    def from_sizes(cls, procs_per_host: list[int]) -> "Topology":
        hosts, start = [], 0
        for n in procs_per_host:
            hosts.append(tuple(range(start, start + n)))
            start += n
        return cls(tuple(hosts))

    @classmethod
    def uniform(cls, hosts: int, per_host: int) -> "Topology":
        return cls.from_sizes([per_host] * hosts)

    @classmethod
    def from_host_ids(cls, host_of_rank: list[object]) -> "Topology":
        """From what each rank reports as its host (e.g. torchrun's GROUP_RANK), in rank order."""
        order: dict[object, list[int]] = {}
        for rank, host in enumerate(host_of_rank):
            order.setdefault(host, []).append(rank)
        return cls(tuple(tuple(r) for r in order.values()))

    @property
    def world_size(self) -> int:
        return sum(len(h) for h in self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    def host_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.hosts):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is not in {self.hosts}")

    def local_rank(self, rank: int) -> int:
        return self.hosts[self.host_of(rank)].index(rank)

    def inter_host_groups(self) -> list[tuple[int, ...]]:
        """Group j holds the j-th rank of every host that has one (for hierarchical collectives)."""
        depth = max(len(h) for h in self.hosts)
        return [tuple(h[j] for h in self.hosts if j < len(h)) for j in range(depth)]

    @property
    def can_aggregate_locally(self) -> bool:
        """Local aggregation (two-hop exchanges) needs several hosts of equal size, each with
        more than one rank; the runtime and the cost model both ask here."""
        sizes = {len(h) for h in self.hosts}
        return self.num_hosts > 1 and len(sizes) == 1 and sizes != {1}


__all__ = ["Cluster", "Host", "Link", "Links", "Topology"]
