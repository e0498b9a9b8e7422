"""What each collective puts on the wire: one table, read by the counters (comm/counted.py),
the cost model (estimate/cost.py) and calibration (cluster/calibrate.py), so the three cannot
disagree.

For a call on a group of n ranks, `sent(nbytes, n)` is what one rank sends and `messages(n)` how
many messages the alpha-beta model charges it. `nbytes` is the buffer as the caller passes it:
the whole buffer for all-reduce and all-to-all, one rank's part for all-gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

COUNT_BYTES = 8   # the int64 length each variable-size all-to-all sends every peer first
ID_BYTES = 8      # ids travel as int64
CHECK_BYTES = 16  # per rank per step: the input-check exchange (parallel/data/checks.py), two int64
CHECK_WORDS = 17  # or, riding the last all-reduce bucket: a flag and 8 digests with their squares


@dataclass(frozen=True)
class Collective:
    name: str
    sent: Callable[[int, int], int]
    messages: Callable[[int], int]


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """A ring all-reduce: reduce-scatter then all-gather, each sending n-1 chunks of nbytes/n."""
    return 0 if n <= 1 else 2 * (n - 1) * nbytes // n


def all_to_all_bytes(nbytes: int, n: int) -> int:
    """An evenly split all-to-all: every part but this rank's own leaves."""
    return 0 if n <= 1 else (n - 1) * nbytes // n


def all_gather_bytes(nbytes: int, n: int) -> int:
    """gloo's ring all-gather: this rank's part and n-2 forwarded ones, each `nbytes`."""
    return 0 if n <= 1 else (n - 1) * nbytes


def count_exchange_bytes(n: int) -> int:
    """The int64 lengths a variable-size all-to-all sends every peer before the payload."""
    return COUNT_BYTES * (n - 1) if n > 1 else 0


def id_block_capacity(count: int, capacity: int) -> int:
    """The ids one rank's pull block to a peer holds from the next step on
    (parallel/rows/exchange.py), from what this step sent in that block (`count`) and what it held:
    both ends know both, so they agree without a word. Grows with a quarter's headroom, so a steady
    stream of ids stops overflowing after its largest step. Shrinks to the same headroom only when a
    step's ids need under a quarter of the block: a spike (an evaluation's larger batch) does not
    pad every later step, while ordinary swings between steps never cost an overflow's extra
    meeting."""
    fitted = count + count // 4
    return fitted if count > capacity or 4 * fitted < capacity else capacity


RIDE_BYTES = 64 * 2**10


def bucket_rides_push(nbytes: int, n: int) -> bool:
    """Whether the last dense bucket (`nbytes` with what rides it) goes whole to every peer at
    the end of the server push's all-to-all, each rank summing what arrives, instead of an
    all-reduce of its own (parallel/data/dense.py): while the ride sends at most 64 KiB, where a
    step's meetings, not its bytes, are the cost. Measured (2 ranks, gloo): an async all-reduce
    beside the push cost 1.2-1.9 ms, the push carrying it 0.4-0.6 ms (3k-20k floats), and the
    recommender's step (6 KB bucket) fell to 0.67-0.84x TorchRec's at 2 emulated hosts; but
    an LM's 430 KB bucket riding on 850 Mbit/s links made its step 1.26-1.34x DDP-sparse's
    against 1.13x all-reduced, so a large bucket keeps its all-reduce. The ride sends (n-1)
    times the bucket (the ring 2(n-1)/n): the same at 2 ranks, more beyond."""
    return n > 1 and (n - 1) * nbytes <= RIDE_BYTES


ALL_REDUCE = Collective("all_reduce", ring_allreduce_bytes, lambda n: 2 * (n - 1))
ALL_TO_ALL = Collective("all_to_all", all_to_all_bytes, lambda n: n - 1)
ALL_GATHER = Collective("all_gather", all_gather_bytes, lambda n: n - 1)
# A reduce-scatter of a buffer of n equal chunks: every chunk but this rank's own leaves once (as
# gloo does it here, an all-to-all then a local sum; a ring sends the same bytes).
REDUCE_SCATTER = Collective("reduce_scatter", all_to_all_bytes, lambda n: n - 1)
SEND_RECV = Collective("send_recv", lambda nbytes, n: nbytes, lambda n: 1)
# Every rank sends its buffer to the next and receives the previous one's at once: a step of
# ring attention's exchange (parallel/context/comm.py), the link crossed both ways together.
# One rank passes its buffer to itself: nothing moves (as the ring counts it).
RING_SHIFT = Collective("ring_shift", lambda nbytes, n: nbytes if n > 1 else 0,
                        lambda n: 1 if n > 1 else 0)

COLLECTIVES: dict[str, Collective] = {c.name: c for c in (ALL_REDUCE, ALL_TO_ALL, ALL_GATHER,
                                                          REDUCE_SCATTER, SEND_RECV, RING_SHIFT)}


def input_check_bytes(n: int) -> int:
    """The per-step input check when it travels alone (no float bucket to ride): its 16 bytes
    all-gathered."""
    return all_gather_bytes(CHECK_BYTES, n)


# PowerSGD (grad_compress="powersgd", parallel/data/powersgd.py): which gradients go as rank-r
# factors, by torch's rule (powerSGD_hook._should_compress with its default min_compression_rate),
# so a job moved from DDP's hook compresses the same tensors.
LOW_RANK_MIN_RATE = 2


def low_rank_view(shape: tuple[int, ...], rank: int) -> tuple[int, int, int] | None:
    """PowerSGD's matrix of a gradient of `shape` (its first dimension by the rest) and the
    rank of its factors, (rows, cols, r), where the factors P (rows x r) and Q (cols x r) take
    under 1/LOW_RANK_MIN_RATE of its values; None where it is sent as it is (vectors, scalars,
    small or thin matrices)."""
    if not shape or rank < 1:
        return None
    rows, cols = shape[0], math.prod(shape[1:])
    r = min(rows, cols, rank)
    return (rows, cols, r) if (rows + cols) * r * LOW_RANK_MIN_RATE < rows * cols else None


def low_rank_values(shapes: list[tuple[int, ...]], rank: int) -> tuple[int, int]:
    """The values of a PowerSGD bucket's two all-reduces: the first carries the gradients sent
    as they are and every P, the second every Q."""
    first = second = 0
    for shape in shapes:
        view = low_rank_view(shape, rank)
        if view is None:
            first += math.prod(shape)
        else:
            rows, cols, r = view
            first += rows * r
            second += cols * r
    return first, second


# Top-k (grad_compress="topk", parallel/data/topk.py): each rank's k largest values of a bucket
# go as their positions (int32, int64 in a bucket past int32's range) and the values,
# all-gathered.
def topk_index_bytes(numel: int) -> int:
    return 4 if numel < 2**31 else 8


def topk_count(numel: int, ratio: float) -> int:
    """Values a rank sends of a bucket of `numel`: the `ratio` share, at least one."""
    return min(numel, max(1, math.ceil(ratio * numel)))
