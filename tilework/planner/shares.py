"""Uneven data shares for ranks that differ (paper 1, HAP): how many samples of each global
batch every data-parallel rank takes, so that the slowest finishes no later than it must.

A data-parallel step ends when its slowest rank does: rank r's compute is about n_r samples at
t_r seconds each (t_r = 1 / speed_r), so the step is max_r n_r t_r, and the sum of n_r is the
global batch. HAP sets its ratios by a linear program; with one resource and linear times its
optimum is the water-filling one: shares in proportion to speed, each capped by what its memory
holds. `batch_shares` finds the integer optimum greedily (each sample to the rank that would
finish it soonest, among those with room), which for this min-max problem is exact: a rank
that gets a sample never has to give it back.

Pure: the speeds and caps come from the cluster file (`speed`, `memory_gb`) or calibration.
"""

from __future__ import annotations

import heapq

from ..errors import ConfigError


def batch_shares(global_batch: int, speeds, caps=None) -> tuple[int, ...]:
    """Samples per rank of a `global_batch`, minimising the slowest rank's time (n_r /
    speeds[r]); `caps`: the most samples each rank's memory holds (None: no limit). Equal
    speeds give the even split (the first ranks take the remainder, as numpy's array_split
    does). Raises ConfigError if the caps cannot hold the batch."""
    speeds = [float(s) for s in speeds]
    if not speeds or any(not s > 0 for s in speeds):
        raise ConfigError("speed", f"expected a positive speed for every rank, got {speeds}")
    if global_batch < len(speeds):
        raise ConfigError("batch_size", f"a global batch of {global_batch} cannot give each of "
                                        f"{len(speeds)} ranks a sample")
    caps = [None] * len(speeds) if caps is None else list(caps)
    if len(caps) != len(speeds):
        raise ValueError(f"caps: one per rank ({len(speeds)}), got {len(caps)}")
    room = sum(global_batch if c is None else c for c in caps)
    if room < global_batch:
        raise ConfigError("batch_size", f"the ranks' memory holds {room} samples of a step, "
                                        f"the global batch is {global_batch}")
    if any(c is not None and c < 1 for c in caps):
        raise ConfigError("memory_gb", f"every rank must hold at least one sample, caps {caps}")
    # Every rank starts with one sample (no rank idles); then each sample goes to the rank
    # that would finish it first: (time after taking it, rank) in a heap.
    shares = [1] * len(speeds)
    heap = [(2 / s, r) for r, s in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(global_batch - len(speeds)):
        while True:
            _, r = heapq.heappop(heap)
            if caps[r] is None or shares[r] < caps[r]:
                break
        shares[r] += 1
        heapq.heappush(heap, ((shares[r] + 1) / speeds[r], r))
    return tuple(shares)


def step_time(shares, speeds, per_sample_s: float) -> float:
    """The slowest rank's compute: n_r samples at per_sample_s / speed_r each."""
    return max(n * per_sample_s / s for n, s in zip(shares, speeds))


def ideal_time(global_batch: int, speeds, per_sample_s: float) -> float:
    """The additive ideal: the batch at the sum of the speeds."""
    return global_batch * per_sample_s / sum(speeds)


def gradient_weights(shares) -> tuple[float, ...]:
    """What each rank's gradient is multiplied by before the usual mean over ranks so that
    the result is the gradient of the global batch's mean loss: a rank's loss is the mean over
    its n_r samples, so sum_r (n_r / N) g_r = mean_r (W n_r / N) g_r."""
    total, world = sum(shares), len(shares)
    return tuple(world * n / total for n in shares)


# Partitions per unit of the smallest weight when ranks serve unevenly: a rank's rows are then
# within one partition (1 / (GRAIN x world) of the table) of its weight's share.
GRAIN = 8


def server_partitions(rows: int, world_size: int) -> int:
    """How many partitions a server table is cut into for ranks that serve unevenly: enough
    that every rank's share of the rows is close to its weight's, at most one per row."""
    return min(rows, GRAIN * world_size)


def server_map(partitions: int, weights) -> tuple[int, ...]:
    """The rank serving each partition: partition by partition, to the rank whose partitions
    over its weight would be lowest after taking it (ties to the lower rank). As for the batch
    shares, the greedy order is the min-max optimum: the most loaded rank relative to its
    weight (its memory) is as light as any split makes it. Equal weights give round robin.
    Raises ConfigError on a weight that is not positive."""
    weights = [float(w) for w in weights]
    if not weights or any(not 0 < w < float("inf") for w in weights):
        raise ConfigError("server_weights", f"expected a positive weight for every rank, got "
                                            f"{weights}")
    served = [0] * len(weights)
    out = []
    for _ in range(partitions):
        r = min(range(len(weights)), key=lambda k: ((served[k] + 1) / weights[k], k))
        served[r] += 1
        out.append(r)
    return tuple(out)


def zero_chunks(numel: int, weights) -> tuple[int, ...]:
    """Each rank's elements of a ZeRO parameter of `numel` elements, in proportion to
    `weights` (its memory), summing to `numel`: the largest remainders round up (ties to the
    lower rank). Equal weights give () (the even cut, which pads instead)."""
    weights = [float(w) for w in weights]
    if not weights or any(not 0 < w < float("inf") for w in weights):
        raise ConfigError("zero_weights", f"expected a positive weight for every rank, got "
                                          f"{weights}")
    if len(set(weights)) == 1:
        return ()
    total = sum(weights)
    exact = [numel * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in by_remainder[:numel - sum(counts)]:
        counts[r] += 1
    return tuple(counts)


__all__ = ["batch_shares", "gradient_weights", "ideal_time", "server_map", "server_partitions",
           "step_time", "zero_chunks"]
