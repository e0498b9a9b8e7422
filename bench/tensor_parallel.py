"""Tensor parallelism beside DDP at the same world size, on the reference GPT.

    torchrun --nproc-per-node 2 bench/tensor_parallel.py [--dim 256 --layers 4 --heads 8
        --seq 128 --vocab 8192 --batch 16 --rounds 3 --steps 10]

Three systems train the same global batch (strong scaling) with Adam: `ddp` (torch's
DistributedDataParallel, every rank the whole model and half the batch), `tp`
(tilework.parallel.tensor with the GPT's built-in layout, tp = world size, every rank a 1/tp shard
of each split layer and the whole batch) and `tp-sp` (the same with sequence parallelism). Each
round builds every system afresh and times `steps` steps after 3 warm-up steps; a step's time is its
slowest rank's, a round's the median step; rounds interleave the systems so that drifts in the
machine's speed hit all alike. Memory per rank, exact, from the tensors themselves: parameters,
gradients, Adam's state, and the activations autograd saves for backward (distinct storages,
seen through saved_tensors_hooks). Bytes per step: counted for tp, the ring all-reduce of every
gradient for DDP (comm/wire.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from tilework.comm import exit_worker
from tilework.comm.counted import Stats
from tilework.comm.wire import ring_allreduce_bytes
from tilework.models.gpt import TinyGPT
from tilework.parallel.tensor import TensorParallel, apply_layout, layout_for

SYSTEMS = ("ddp", "tp", "tp-sp")


def build(system: str, a, stats: Stats):
    torch.manual_seed(0)
    model = TinyGPT(vocab=a.vocab, dim=a.dim, heads=a.heads, layers=a.layers, seq_len=a.seq)
    if system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        tp = TensorParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size(),
                            sequence_parallel=system == "tp-sp", stats=stats)
        apply_layout(model, layout_for(model), tp)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step: int, system: str, a):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    if system == "ddp":   # each rank its share; tensor-parallel ranks all see the whole batch
        n, rank = dist.get_world_size(), dist.get_rank()
        tokens = tokens.chunk(n)[rank]
    return tokens[:, :-1], tokens[:, 1:]


def saved_bytes(model, inputs) -> tuple[torch.Tensor, int]:
    """The loss, and the bytes of the distinct storages autograd keeps for its backward."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return loss, sum(b for ptr, b in seen.items() if ptr not in params)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_round(system: str, a) -> dict:
    stats = Stats()
    model, opt = build(system, a, stats)
    times, activations = [], 0
    for step in range(3 + a.steps):
        inputs = batch(step, system, a)
        dist.barrier()
        start = time.perf_counter()
        loss, saved = saved_bytes(model, inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if step >= 3:
            times.append(time.perf_counter() - start)
        activations = saved
        stats.end_step()
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    sent = sum(t.sent for t in stats.last_step.values()) if system != "ddp" else \
        ring_allreduce_bytes(nbytes(params), dist.get_world_size())
    return {"time": statistics.median(slowest.tolist()), "params": nbytes(params),
            "grads": nbytes(p.grad for p in params), "optimizer": nbytes(state),
            "activations": activations, "sent": sent}


def report(results: dict[str, list[dict]], a) -> None:
    ddp = results["ddp"]
    base_time = statistics.median(r["time"] for r in ddp)
    base_static = ddp[0]["params"] + ddp[0]["grads"] + ddp[0]["optimizer"]
    print(f"GPT dim {a.dim}, {a.layers} layers, {a.heads} heads, seq {a.seq}, vocab {a.vocab}, "
          f"global batch {a.batch}; {dist.get_world_size()} ranks; rounds x steps "
          f"{a.rounds} x {a.steps}")
    print(f"{'system':>6} {'ms/step':>8} {'x DDP':>6} {'params':>8} {'grads':>8} {'adam':>8} "
          f"{'p+g+adam':>9} {'x DDP':>6} {'activ.':>8} {'x DDP':>6} {'sent/step':>10}")
    mib = 2 ** 20
    for system, rounds in results.items():
        t = statistics.median(r["time"] for r in rounds)
        r = rounds[0]
        static = r["params"] + r["grads"] + r["optimizer"]
        print(f"{system:>6} {t * 1e3:8.1f} {t / base_time:6.2f} {r['params'] / mib:7.2f}M "
              f"{r['grads'] / mib:7.2f}M {r['optimizer'] / mib:7.2f}M {static / mib:8.2f}M "
              f"{static / base_static:6.2f} {r['activations'] / mib:7.2f}M "
              f"{r['activations'] / ddp[0]['activations']:6.2f} {r['sent'] / mib:9.2f}M")
        print(f"{'':>6} rounds ms: " + " ".join(f"{x['time'] * 1e3:.1f}" for x in rounds))


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("dim", 256), ("layers", 4), ("heads", 8), ("seq", 128),
                          ("vocab", 8192), ("batch", 16), ("rounds", 3), ("steps", 10)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for _ in range(a.rounds):
        for system in SYSTEMS:
            results[system].append(run_round(system, a))
    if dist.get_rank() == 0:
        report(results, a)
    exit_worker(0)  # not a normal exit: see tilework.comm.exit_worker


if __name__ == "__main__":
    main()
