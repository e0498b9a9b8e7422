"""Predicted vs measured per-step communication of the sparse workloads on emulated hosts.

Driven by `bench/comm_prediction.py`; this module holds the pure parts (traffic measured from
the batches, the predictions, the measured communication of a step, the table) and the rank
worker, run as

    python -m tilework.bench.comm_prediction worker --workload lm100k --system hybrid ...
    python -m tilework.bench.comm_prediction links --sizes 32768,131072,524288 --out l.json

in every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; inside emulated hosts).

Measured communication of a step = the step's time (slowest rank) minus the same step's
compute, measured right after in the same processes with communication removed: the plain,
unparallelised model (sparse embedding gradients, plain SGD) on the same per-rank batch, every
rank computing at once (a barrier before each step, none inside), so that the n processes share
the 2 cores as they did in the real step. What that leaves is the time the step spent in, or
blocked on, communication, plus whatever CPU work the system adds around it (tilework's
unique/index_add bookkeeping, gloo's sparse coalescing), which the cost model does not count.
Communication a system overlaps with compute (DDP's all-gathers during backward) is not seen:
it is the exposed communication.

Prediction: the cost model (`tilework.estimate.cost`) on the plan the system ran, with the traffic
the batches really touched (distinct rows per rank and in the world, from the ids) and the links
fitted on the same emulated network, per collective (`links` mode: all_reduce, all_to_all and
all_gather timed like `tilework calibrate` and fitted with its `fit_alpha_beta`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pickle
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cluster.topology import Link, Links, Topology
from ..comm.wire import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, ID_BYTES, ring_allreduce_bytes
from ..estimate.cost import (
    TableTraffic,
    dense_rides_push,
    predict,
    ps_meetings,
    ps_step_bytes,
    ring_allreduce,
    seconds,
    shared_meetings,
    sparse_allgather,
)

SPARSE_WORKLOADS = ("lm100k", "lm800k", "recommender")
LINK_COLLECTIVES = ("all_reduce", "all_to_all", "all_gather")
WIRE = {"all_reduce": ALL_REDUCE, "all_to_all": ALL_TO_ALL, "all_gather": ALL_GATHER}


# -- pure: traffic, links, predictions -----------------------------------------------------------

def table_ids(workload: str, inputs: tuple) -> dict[str, torch.Tensor]:
    """The ids each table of a sparse bench workload looks up in one rank's batch."""
    if workload.startswith("lm"):
        tokens, targets, negatives = inputs
        softmax = torch.cat([targets.reshape(-1), negatives.reshape(-1)])
        return {"embedding.weight": tokens.reshape(-1), "softmax_weight.weight": softmax,
                "softmax_bias.weight": softmax}
    if workload == "recommender":
        ids = inputs[1]
        return {f"tables.{i}.weight": ids[:, i] for i in range(ids.shape[1])}
    raise ValueError(f"not a sparse bench workload: {workload!r}")


def measured_traffic(steps: list[list[dict[str, torch.Tensor]]],
                     ranks_per_host: int = 1,
                     rows: dict[str, int] | None = None) -> dict[str, TableTraffic]:
    """Each table's traffic as the cost model reads it, from the ids really looked up:
    `steps[s][r][table]` are rank r's ids in step s. Distinct rows per rank (mean over ranks and
    steps), per host (the union of a host's `ranks_per_host` consecutive ranks) and in the
    world (the union of every rank's), each averaged over the steps. With each table's `rows`,
    the ids themselves too (`TableTraffic.measured`): how they spread over a contiguous
    table's partitions, which decides the busiest server's load."""
    if not steps or not steps[0]:
        raise ValueError("need at least one step of one rank")
    n = len(steps[0])
    if n % ranks_per_host:
        raise ValueError(f"{n} ranks do not split into hosts of {ranks_per_host}")
    out = {}
    for name in steps[0][0]:
        per_rank, per_host, world, pooled = [], [], [], []
        for ranks in steps:
            uniq = [torch.unique(r[name]) for r in ranks]
            pooled += uniq
            per_rank += [len(u) for u in uniq]
            per_host += [len(torch.unique(torch.cat(uniq[h:h + ranks_per_host])))
                         for h in range(0, n, ranks_per_host)]
            world.append(len(torch.unique(torch.cat(uniq))))
        measured = None
        if rows is not None and name in rows:
            ids = torch.sort(torch.cat(pooled)).values
            measured = (rows[name], tuple(ids.tolist()), len(pooled))
        out[name] = TableTraffic(statistics.fmean(per_rank), statistics.fmean(per_host),
                                 statistics.fmean(world), measured=measured)
    return out


def fitted_link(points: list[tuple[int, float]], collective: str, n: int) -> Link:
    """A cost-model link from (wire bytes one rank sends, seconds) of one collective on n ranks:
    `calibrate.fit_alpha_beta`, alpha spread over the collective's messages (as calibrate
    writes a cluster file's link), so cost.seconds(bytes, link, messages) is the fitted line."""
    from ..cluster.calibrate import fit_alpha_beta

    alpha, beta = fit_alpha_beta([p[0] for p in points], [p[1] for p in points])
    return Link(bandwidth_gbps=beta * 8 / 1e9,
                latency_us=alpha * 1e6 / WIRE[collective].messages(n))


@dataclass(frozen=True)
class Prediction:
    seconds: float            # per-collective links (what the table judges)
    bytes_sent: float         # what the model says one rank sends
    single_link_s: float      # every term on the all_reduce link (a cluster file's one link)
    terms: dict               # seconds by term, per-collective links


def predict_hybrid(plan, traffic: dict[str, TableTraffic], n: int,
                   links: dict[str, Link]) -> Prediction:
    """`estimate/plan_cost.comm_seconds` for `plan` on n one-rank hosts, with the dense
    bucketed all-reduce on the all_reduce link and each server table (`cost.predict`:
    ps_expected, its head) on the all_to_all link. Tables are costed one by one, as the planner
    does, less the meetings they share (`cost.shared_meetings`: pulled and pushed together)."""
    topo = Topology.from_sizes([1] * n)

    def run(ar: Link, a2a: Link):
        terms, sent = {}, 0.0
        dense = sum(pp.nbytes for pp in plan.of("allreduce") if not pp.zero)
        if dense and dense_rides_push(plan, topo):   # bytes on the push's link, no meeting
            terms["dense riding the push"] = seconds((n - 1) * dense, a2a, 0)
            sent += (n - 1) * dense
        elif dense:
            c = ring_allreduce(dense, topo, Links(inter=ar), math.ceil(dense / plan.bucket_bytes))
            terms["dense all-reduce"], sent = c.seconds, sent + c.bytes_sent
        for pp in plan.of("ps"):
            c = predict(pp, traffic.get(pp.name), topo, Links(inter=a2a), plan.local_aggregation)
            if c is None:
                raise ValueError(f"no traffic for server table {pp.name}")
            terms[f"ps {pp.name}"], sent = c.seconds, sent + c.bytes_sent
        shared = shared_meetings(plan.of("ps"), traffic, topo, Links(inter=a2a),
                                 plan.local_aggregation)
        if shared:
            terms["meetings the tables share"] = -shared
        return terms, sent

    terms, sent = run(links["all_reduce"], links["all_to_all"])
    single, _ = run(links["all_reduce"], links["all_reduce"])
    return Prediction(sum(terms.values()), sent, sum(single.values()), terms)


def hybrid_exact(plan, ids_steps: list[list[dict[str, torch.Tensor]]], n: int,
                 links: dict[str, Link]) -> tuple[float, list[float]]:
    """A diagnostic beside `predict_hybrid`: the server tables' bytes from the exact replay of
    the runtime's routing (`cost.ps_step_bytes`, equal to the counters: every table in one
    exchange) on the ids the batches looked up, instead of the expected model's even spread
    over the servers. Returns (seconds of the busiest rank: the dense all-reduce plus its exact
    bytes and the servers' three meetings a step on the all_to_all link, averaged over the
    steps; each rank's bytes per step, averaged)."""
    topo = Topology.from_sizes([1] * n)
    per_rank = [0.0] * n
    served = plan.of("ps")
    id_blocks: dict = {}   # carried step to step
    for ranks in ids_steps:
        if served:
            sent = ps_step_bytes(served, [[r[pp.name] for r in ranks] for pp in served], topo,
                                 plan.local_aggregation, id_blocks)
            per_rank = [a + b / len(ids_steps) for a, b in zip(per_rank, sent)]
    dense = sum(pp.nbytes for pp in plan.of("allreduce") if not pp.zero)
    if dense and dense_rides_push(plan, topo):
        t = seconds((n - 1) * dense, links["all_to_all"], 0)
    else:
        t = ring_allreduce(dense, topo, Links(inter=links["all_reduce"]),
                           math.ceil(dense / plan.bucket_bytes)).seconds if dense else 0.0
    if served:   # one exchange for the tables of each dtype, as the runtime batches them
        t += seconds(max(per_rank), links["all_to_all"], 0) + ps_meetings(
            n, links["all_to_all"]) * len({pp.dtype for pp in served})
    return t, per_rank


def predict_ddp_sparse(dense_bytes: int, tables: dict[str, int],
                       traffic: dict[str, TableTraffic], n: int, links: dict[str, Link],
                       bucket_bytes: int = 25 * 2**20) -> Prediction:
    """`report.report`'s DDP-with-sparse-gradients line: the dense gradients in DDP's buckets,
    all-reduced; each table's (ids, rows) all-gathered (`cost.sparse_allgather`), on the
    all_gather link. `tables`: row bytes by table name."""
    topo = Topology.from_sizes([1] * n)

    def run(ar: Link, ag: Link):
        terms, sent = {}, 0.0
        if dense_bytes:
            c = ring_allreduce(dense_bytes, topo, Links(inter=ar),
                               max(1, math.ceil(dense_bytes / bucket_bytes)))
            terms["dense all-reduce"], sent = c.seconds, sent + c.bytes_sent
        for name, row_bytes in tables.items():
            c = sparse_allgather(traffic[name], topo, Links(inter=ag), row_bytes)
            terms[f"all-gather {name}"], sent = c.seconds, sent + c.bytes_sent
        return terms, sent

    terms, sent = run(links["all_reduce"], links["all_gather"])
    single, _ = run(links["all_reduce"], links["all_reduce"])
    return Prediction(sum(terms.values()), sent, sum(single.values()), terms)


def torchrec_owners(sharding: str) -> dict[str, tuple[str, list[int]]]:
    """`torchrec_peer._sharding`'s 't0:table_wise@1; t2:data_parallel@' as
    {table: (sharding type, ranks)}."""
    out = {}
    for part in filter(None, (p.strip() for p in sharding.split(";"))):
        name, rest = part.split(":", 1)
        kind, ranks = rest.split("@", 1)
        out[name] = (kind, [int(r) for r in ranks.split(",") if r])
    return out


def torchrec_bytes(sharding: str, batch_per_rank: int, dims: list[int], dense_bytes: int,
                   n: int) -> list[float]:
    """What each rank sends in a TorchRec table-wise step of one-id bags (the recommender):
    first every feature's length total to every peer (the KJT all-to-all's splits, 8 bytes a
    feature), then its ids and their lengths (8 bytes each) to each table's owner; as an
    owner, every other rank's pooled rows (batch x dim fp32) back; their gradients to the owner
    in backward; and the DDP ring all-reduce of the dense layers and of any data-parallel
    table. Equal to torchrec_peer.ByteCounter's count (tests/bench/test_comm_prediction.py). Tables
    sharded another way are refused: the model has no term for them."""
    owners = torchrec_owners(sharding)
    sent = [float((n - 1) * len(dims) * 8)] * n
    for i, dim in enumerate(dims):
        kind, ranks = owners[f"t{i}"]
        if kind == "data_parallel":   # the caller counts its rows in `dense_bytes`
            continue
        if kind != "table_wise" or len(ranks) != 1:
            raise ValueError(f"t{i}: {kind} on {ranks}: only table-wise tables are modelled")
        pooled = batch_per_rank * dim * 4
        for r in range(n):
            if r == ranks[0]:
                sent[r] += (n - 1) * pooled
            else:
                sent[r] += batch_per_rank * (ID_BYTES + 8) + pooled
    ring = ring_allreduce_bytes(dense_bytes, n)
    return [s + ring for s in sent]


def predict_torchrec(sharding: str, batch_per_rank: int, dims: list[int], dense_bytes: int,
                     n: int, links: dict[str, Link]) -> Prediction:
    """TorchRec table-wise: the DDP ring all-reduce of the dense layers on the all_reduce link,
    and the busiest rank's exchange bytes (`torchrec_bytes` less the ring) in its five
    all-to-alls (splits, lengths, ids, pooled rows, their gradients) on the all_to_all link."""
    topo = Topology.from_sizes([1] * n)
    ring = ring_allreduce_bytes(dense_bytes, n)
    exchange = max(torchrec_bytes(sharding, batch_per_rank, dims, dense_bytes, n)) - ring

    def run(ar: Link, a2a: Link):
        terms = {"dense all-reduce": ring_allreduce(dense_bytes, topo, Links(inter=ar)).seconds,
                 "all-to-alls": seconds(exchange, a2a, 5 * ALL_TO_ALL.messages(n))}
        return terms

    terms = run(links["all_reduce"], links["all_to_all"])
    single = run(links["all_reduce"], links["all_reduce"])
    return Prediction(sum(terms.values()), exchange + ring, sum(single.values()), terms)


def measured_comm(step_s: list[float], compute_s: list[float]) -> float:
    """Median over steps of (step time - the same step's compute), both the slowest rank's."""
    if len(step_s) != len(compute_s) or not step_s:
        raise ValueError("one compute time per step, at least one step")
    return statistics.median(s - c for s, c in zip(step_s, compute_s))


def within(ratio: float, tolerance: float = 0.25) -> bool:
    return abs(ratio - 1) <= tolerance


def lead(ddp_sparse_s: float, hybrid_s: float) -> float:
    """Hybrid's lead over DDP-sparse: DDP-sparse's communication time over hybrid's."""
    return ddp_sparse_s / hybrid_s


def markdown_rows(rows: list[dict], tolerance: float = 0.25) -> list[str]:
    """The table: one line per (hosts, workload, system) with predicted, measured and ratio."""
    lines = ["| hosts | workload | system | step ms | compute ms | measured comm ms | "
             "predicted ms | ratio (measured / predicted) | within 25% | predicted on the "
             "all_reduce link alone, ms | MB sent/step: model / counted | hybrid: exact "
             "replay's busiest rank, ms (ratio) |",
             "|---:|---|---|---:|---:|---:|---:|---:|:---:|---:|---|---|"]
    for r in rows:
        ratio = r["measured_s"] / r["predicted_s"]
        counted = "-" if r.get("counted_bytes") is None else f"{r['counted_bytes'] / 1e6:.3f}"
        exact = "-" if r.get("exact_s") is None else \
            f"{r['exact_s'] * 1e3:.1f} ({r['measured_s'] / r['exact_s']:.2f})"
        lines.append(
            f"| {r['hosts']} | {r['workload']} | {r['system']} | {r['step_s'] * 1e3:.1f} | "
            f"{r['compute_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | "
            f"{r['predicted_s'] * 1e3:.1f} | {ratio:.2f} | "
            f"{'yes' if within(ratio, tolerance) else 'NO'} | {r['single_link_s'] * 1e3:.1f} | "
            f"{r['predicted_bytes'] / 1e6:.3f} / {counted} | {exact} |")
    return lines


# -- the rank workers ----------------------------------------------------------------------------

def bench_workload(name: str, recommender_batch: int | None = None):
    from . import workloads

    if name == "recommender" and recommender_batch:
        return workloads._recommender(global_batch=recommender_batch)
    return workloads.WORKLOADS[name]


def _slowest(times: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def wait_at_gate(gate: str | None, rank: int, poll_s: float = 0.05) -> None:
    """Set-up done: rank 0 says so (`<gate>/ready`) and every rank waits until the driver
    answers (`<gate>/go`), which it does once it has shaped the links, so that set-up (the
    initial broadcasts of 800k-row tables) runs unshaped. No gate: nothing to wait for."""
    import torch.distributed as dist

    if gate is None:
        return
    dist.barrier()
    if rank == 0:
        Path(gate, "ready").touch()
        while not Path(gate, "go").exists():
            time.sleep(poll_s)
    dist.barrier()


def run_worker(workload_name: str, system: str, steps: int, warmup: int,
               recommender_batch: int | None, gate: str | None = None) -> dict:
    """This rank's part: `steps` timed steps of `system` after `warmup`, then the same steps'
    compute alone (the plain model, all ranks at once). Returns rank-agnostic results.
    `gate`: a directory to wait at after set-up (`wait_at_gate`)."""
    import torch.distributed as dist

    from .worker import _setup, timed_steps

    workload = bench_workload(workload_name, recommender_batch)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, opt, counter, extra = _setup(workload, system, n)
    wait_at_gate(gate, rank)
    times, sent = timed_steps(workload, system, model, opt, counter, rank, n, steps, warmup)
    engine = getattr(model, "_tilework_engine", None)
    plan = pickle.dumps(engine.plan).hex() if engine is not None else None
    # The compute alone: the plain model on the same batches, every rank at once.
    torch.manual_seed(0)
    plain = workload.make(True)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    compute = []
    for step in range(warmup + steps):
        inputs = workload.batch(step, rank, n)
        dist.barrier()
        start = time.perf_counter()
        plain(*inputs).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        if step >= warmup:
            compute.append(time.perf_counter() - start)
    step_s, compute_s = _slowest(times), _slowest(compute)
    sent_t = torch.tensor(sent, dtype=torch.float64)
    dist.all_reduce(sent_t, op=dist.ReduceOp.MAX)   # the busiest rank's bytes
    dist.destroy_process_group()
    return {"workload": workload_name, "system": system, "world_size": n, "step_s": step_s,
            "compute_s": compute_s, "counted_bytes": statistics.median(sent_t.tolist()),
            "plan": plan, **{k: v for k, v in extra.items() if isinstance(v, str)}}


def time_links(sizes: list[int], repeats: int) -> dict:
    """Each of LINK_COLLECTIVES timed on float32 buffers of about `sizes` bytes (for
    all_gather: each rank's part), slowest rank's time from a barrier, median of `repeats` after
    a warm-up: {collective: [(wire bytes one rank sends, seconds)]}."""
    import torch.distributed as dist

    n = dist.get_world_size()
    out = {}
    for name in LINK_COLLECTIVES:
        pts = []
        for nbytes in sizes:
            elems = max(n, nbytes // 4 // n * n)
            send, recv = torch.ones(elems), torch.empty(elems)
            parts = [torch.empty(elems) for _ in range(n)]
            ts = []
            for r in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                if name == "all_reduce":
                    dist.all_reduce(send)
                elif name == "all_to_all":
                    dist.all_to_all_single(recv, send)
                else:
                    dist.all_gather(parts, send)
                if r:
                    ts.append(time.perf_counter() - start)
            pts.append((WIRE[name].sent(elems * 4, n), statistics.median(_slowest(ts))))
        out[name] = pts
    return out


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m tilework.bench.comm_prediction")
    sub = p.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--workload", required=True, choices=SPARSE_WORKLOADS)
    w.add_argument("--system", required=True)
    w.add_argument("--steps", type=int, default=4)
    w.add_argument("--warmup", type=int, default=2)
    w.add_argument("--recommender-batch", type=int, default=None)
    w.add_argument("--out", required=True)
    w.add_argument("--gate", help="a directory: wait there after set-up (wait_at_gate)")
    lk = sub.add_parser("links")
    lk.add_argument("--sizes", required=True)
    lk.add_argument("--repeats", type=int, default=3)
    lk.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from ..cluster.worker_env import WorkerEnv

    env = WorkerEnv.from_environ()
    if a.mode == "worker":
        result = run_worker(a.workload, a.system, a.steps, a.warmup, a.recommender_batch,
                            a.gate)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        result = {"world_size": dist.get_world_size(),
                  "points": time_links([int(s) for s in a.sizes.split(",")], a.repeats)}
        dist.destroy_process_group()
    if env.rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    from ..comm import exit_worker

    exit_worker(0)


if __name__ == "__main__":
    main()
