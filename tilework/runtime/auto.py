"""plan="auto" in a live job: the planner's search (planner/search.py, pure) fed with what this
world is. The ranks' hosts come from the discovered topology, the links from the cluster file
(or, without one, an all-reduce fit timed here: inside a host and across hosts, as `tilework
calibrate` fits them), each rank's memory from the cluster file or else from the device (a GPU's
memory; on a CPU host its RAM over the ranks sharing it), and the compute from the ops each
candidate runs (estimate/ops.py): the matmuls by an efficiency curve measured here (each
product priced by its shape), every other op timed here. Every rank must choose the
same plan: the rates and the memory are the smallest any rank measured (all-reduces), so the
pure search gives one answer everywhere.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch import nn

from ..cluster.topology import Cluster, Link, Links
from ..comm.counted import Stats, all_reduce
from ..comm.groups import Groups
from ..config.parallel import ParallelConfig
from ..errors import PlanError


def choose_live(model: nn.Module, optimizer, config: ParallelConfig, groups: Groups,
                cluster: Cluster | None, example_inputs: tuple | None, traffic: dict | None,
                log: bool) -> ParallelConfig:
    """The config plan="auto" chooses for this world (the same on every rank)."""
    from ..planner.search import Space, auto

    if example_inputs is None:
        raise PlanError("plan='auto' prices each candidate's memory and compute on a batch: "
                        "pass example_inputs=(one rank's batch, as the model takes it) to "
                        "parallelize")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    speeds = _measured_speeds(groups) if cluster is None and config.batch_shares == "auto" \
        else None
    live = _live_cluster(groups, cluster, _timed_links(groups) if cluster is None else None,
                         speeds)
    flops = _measured_curve(groups)
    memory = _agreed_memory(groups, _device_memory(groups))
    space = Space.of(config)
    if optimizer is None:   # a hand-written update: no optimizer to shard, no server to step
        config = dataclasses.replace(config, zero=0, mode="allreduce")
        space = dataclasses.replace(space, zero=())
    o = _message_overhead(groups) if space.axes else 0.0
    stepped = optimizer if optimizer is not None else "sgd"
    ops = _measured_ops(groups, model, config, live, example_inputs, space, traffic, flops, o,
                        stepped)
    found = auto(model, config, live, example_inputs, ops, stepped, traffic, memory, space,
                 message_overhead_s=o)
    if log and groups.rank == 0:
        print(f"tilework plan='auto' ({len(found.candidates)} candidates, compute up to "
              f"{float(flops) / 1e9:,.1f} GFLOP/s per rank by matmul shape, "
              f"{len(ops.seconds_of)} other ops timed"
              + (f"; {o * 1e3:.2f} ms of CPU per message end" if o else "")
              + (f"; hosts' speeds {speeds}, measured" if speeds else "")
              + f"): {found.why()}")
    return found.chosen.config


def _live_cluster(groups: Groups, cluster: Cluster | None, timed: Links | None,
                  speeds: list[float] | None = None) -> Cluster:
    """The world's hosts as discovered, with the cluster file's links, memory and speeds where
    given (else the links `timed` and the `speeds` measured here). The speeds are rescaled so
    the slowest host's is 1: the live compute model is every rank's slowest time, which the
    slowest rank's pace must not count again (relative to the fastest, even shares at speeds 1
    and 0.25 were priced at four times the slow rank's own time)."""
    given = speeds if cluster is None else [h.speed for h in cluster.hosts]
    if given is not None:
        given = [s / min(given) for s in given]
    if cluster is None:
        return Cluster.of_topology(groups.topology, timed, speeds=given)
    return Cluster.of_topology(groups.topology, cluster.links,
                               [h.memory_gb for h in cluster.hosts], given)


def _timed_links(groups: Groups) -> Links | None:
    """The links an all-reduce fit gives here, with ZeRO's exchanges' factors against it
    (cluster/calibration_file.exchange_factors) and the small all-to-all's and all-gather's
    meetings against its latency (`latency_factors`), agreed by every rank (the slowest bandwidth,
    latency and factors any group measured); None where there is nothing to time or no fit is
    found (the defaults are used then). A handful of each from 16 kB to 4 MB: about a second
    on loopback. On CPU ranks the latency is most of what tp's many small exchanges cost, which
    the defaults (a GPU node's) would price as free."""
    from ..cluster.calibrate import CalibrationError, fit_points, time_points, time_small_calls
    from ..cluster.calibration_file import MEETINGS, exchange_factors, latency_factors

    if groups.world is None:
        return None
    sizes = [16 * 1024, 256 * 1024, 4 * 1024 * 1024]
    one_host = groups.topology.num_hosts == 1
    timed = {"intra": (groups.world if one_host else groups.intra,
                       len(groups.topology.hosts[groups.host])),
             "inter": (None if one_host else groups.world, groups.world_size)}
    links: dict[str, Link | None] = {}
    failed = False
    for name, (group, size) in timed.items():
        links[name] = None
        if group is None or size < 2:
            continue
        try:
            points = time_points(group, size, sizes, repeats=5,
                                 collectives=("all_reduce", "reduce_scatter", "all_gather",
                                              "ring_shift"), device=groups.device)
            small = time_small_calls(group, size, sizes[0], ("all_reduce",) + MEETINGS,
                                     device=groups.device)
            ring = fit_points("all_reduce", size, points["all_reduce"],
                              small["all_reduce"]).link()
            raw = {c: [(w, t) for _, w, t in pts] for c, pts in points.items()}
            links[name] = Link(ring.bandwidth_gbps, ring.latency_us,
                               **exchange_factors(raw, ring, size),
                               **latency_factors({c: small[c][1:] for c in MEETINGS}, ring,
                                                 size))
        except CalibrationError:   # times that do not grow with size (a loaded machine)
            failed = True
    # The slowest any rank measured: [bandwidth, -latency, -factors] per link, and whether all
    # fitted, in one MIN all-reduce; a link this rank did not time is +inf throughout, which
    # MIN ignores.
    values = []
    for link in links.values():
        values += [link.bandwidth_gbps, -link.latency_us, -link.reduce_scatter_factor,
                   -link.all_gather_factor, -link.ring_shift_factor,
                   -link.all_to_all_latency_factor, -link.all_gather_latency_factor] \
            if link is not None else [float("inf")] * 7
    agreed = torch.tensor(values + [0.0 if failed else 1.0], dtype=torch.float64,
                          device=groups.device)
    all_reduce(agreed, groups.world, Stats(), "setup", op=dist.ReduceOp.MIN)
    *figures, fitted = agreed.tolist()
    if not fitted:
        return None
    intra, inter = (Link(f[0], *(-x for x in f[1:])) if f[0] != float("inf") else None
                    for f in (figures[:7], figures[7:]))
    if intra is None and inter is None:
        return None
    return Links(intra=intra or inter, inter=inter or intra)


def _measured_speeds(groups: Groups) -> list[float] | None:
    """Each host's speed, where no cluster file gives them and the loop feeds each rank its
    share (batch_shares="auto"): every rank's matmul rate at once, each host's slowest over the
    fastest host's (cluster/calibrate.measure_speeds: about a second at full speed); None on
    one host, or where the hosts are within calibrate's SPEED_SPREAD of each other."""
    from ..cluster.calibrate import measure_speeds

    if groups.world is None or groups.topology.num_hosts < 2:
        return None
    return measure_speeds(groups.world, groups.world_size, groups.topology.hosts, groups.device)


def _message_overhead(groups: Groups) -> float:
    """What each message of tp, cp and pp costs a CPU rank at each end beside the link's
    time (cluster/calibrate.message_overhead, with a matmul as the compute: under a second):
    on CPU ranks the sends and receives take cycles from the compute, which for a small model
    is most of a model-parallel step. Zero on GPUs, whose collectives run on their own
    engines."""
    from ..cluster.calibrate import message_overhead

    if groups.world is None or groups.device.type != "cpu":
        return 0.0
    weight = torch.randn(256, 256, device="cpu")   # CPU ranks only (above)
    found = message_overhead(groups.world, groups.world_size, lambda x: x @ weight,
                             torch.randn(512, 256, device="cpu"), actions=30, repeats=3)
    return max(0.0, found["overhead_s"])


def _measured_curve(groups: Groups):
    """The matmul efficiency curve every rank measures at once, the slowest rate at each
    shape (cluster/calibrate.measure_curve): about 2 s on a CPU thread."""
    from ..cluster.calibrate import measure_curve

    return measure_curve(groups.world, groups.world_size, groups.device)


def _measured_ops(groups: Groups, model: nn.Module, config: ParallelConfig, cluster: Cluster,
                  example_inputs: tuple, space, traffic, curve, o: float, optimizer):
    """The op-level compute model (estimate/ops.py) for this search: every op any candidate
    runs, gathered by pricing them once at nothing, the ones beside the matmuls timed here
    (the matmuls go by the curve: a large model's products would take long to time one by one
    on a CPU), and the framework's cost per call; every rank times at once and the slowest
    time of each is agreed. It charges what one FLOP rate cannot: the norms, softmax and
    copies, selective recompute's second run of them, more microbatches' per-op cost, and
    what the runtime copies and `optimizer` updates around them (estimate/runtime_ops.py)."""
    from ..estimate.ops import Collecting, OpTimes, framework_costs, measure
    from ..planner.search import priced_steps
    from .table_costs import table_costs

    asked = Collecting()   # the steps only: memory needs no op times
    priced_steps(model, cluster, example_inputs, asked, config, space, traffic, o, optimizer)
    calls = sorted(asked.asked, key=repr)
    timed = measure(calls, groups.device, matmuls=False)
    costs = framework_costs(groups.device) | table_costs(groups.device)
    regions = sorted(costs)
    values = torch.tensor([timed.get(c, -1.0) for c in calls] + [costs[r] for r in regions],
                          dtype=torch.float64, device=groups.device)
    if groups.world is not None:
        all_reduce(values, groups.world, Stats(), "setup", op=dist.ReduceOp.MAX)
    values = values.tolist()
    seconds = {c: v for c, v in zip(calls, values) if v > 0}
    return OpTimes(seconds, 1.0, dict(zip(regions, values[len(calls):])), curve)


def _device_memory(groups: Groups) -> float:
    """Bytes this rank may use: its GPU's, or its host's RAM over the ranks sharing it."""
    if groups.device.type == "cuda":
        return float(torch.cuda.get_device_properties(groups.device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sharing = next(len(h) for h in groups.topology.hosts if groups.rank in h)
    return ram / sharing


def _agreed_memory(groups: Groups, memory: float) -> float:
    """The smallest memory any rank has (a MIN all-reduce; the curve is agreed as measured)."""
    if groups.world is None:
        return memory
    least = torch.tensor([memory], dtype=torch.float64, device=groups.device)
    all_reduce(least, groups.world, Stats(), "setup", op=dist.ReduceOp.MIN)
    return float(least[0])
