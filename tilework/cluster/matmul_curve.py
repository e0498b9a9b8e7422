"""How fast a rank multiplies, by shape: a matmul efficiency curve instead of one rate.

One FLOP rate prices a small matmul (a tp-split projection, a microbatch of a few sequences) as
fast as a large one; on a GPU a 512-wide GEMM runs at a fraction of a 8192-wide one's rate, and
on a CPU thread small products lose to call and packing overheads. `measure` times a grid of
(m, k, n) products (an (m x k) @ (k x n) matmul: m tokens, k inputs, n outputs) in the dtype
training uses; `MatmulCurve.rate` interpolates the grid trilinearly in log size and log rate,
clamped to its corners (beyond the largest size the rate is taken as flat, below the smallest as
the smallest's).

Pure apart from `measure`: a curve from a calibration file, from published figures, or from a
test can price shapes with no device. `float(curve)` is its best rate, where one number must do
(a printout, a model without matmuls).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from dataclasses import dataclass

SIZES = (16, 64, 256, 1024)   # the CPU grid: 64 products, about 2 s on one thread


@dataclass(frozen=True)
class MatmulCurve:
    sizes: tuple[int, ...]                      # each axis of the grid, increasing
    flops_per_s: tuple[tuple[tuple[float, ...], ...], ...]   # [m][k][n]

    def __post_init__(self):
        s = self.sizes
        if len(s) < 2 or any(a >= b for a, b in zip(s, s[1:])) or s[0] < 1:
            raise ValueError(f"matmul curve: sizes must be two or more increasing positive "
                             f"integers, got {s}")
        shape = (len(s),) * 3
        got = (len(self.flops_per_s), len(self.flops_per_s[0]), len(self.flops_per_s[0][0]))
        if got != shape or any(len(row) != len(s) for plane in self.flops_per_s
                               for row in plane) or \
                any(not v > 0 for plane in self.flops_per_s for row in plane for v in row):
            raise ValueError(f"matmul curve: flops_per_s must be a {shape} grid of positive "
                             "rates")

    def rate(self, m: float, k: float, n: float) -> float:
        """FLOP/s of an (m x k) @ (k x n) product."""
        where = [self._bracket(x) for x in (m, k, n)]
        total = 0.0
        for corner in range(8):
            weight, index = 1.0, []
            for axis, (i, t) in enumerate(where):
                upper = (corner >> axis) & 1
                weight *= t if upper else 1.0 - t
                index.append(i + upper)
            if weight:
                total += weight * math.log(self.flops_per_s[index[0]][index[1]][index[2]])
        return math.exp(total)

    def seconds(self, m: float, k: float, n: float, count: float = 1.0) -> float:
        """Time of `count` such products."""
        return count * 2.0 * m * k * n / self.rate(m, k, n)

    def _bracket(self, x: float) -> tuple[int, float]:
        """(the grid cell's lower index, the position in it, 0..1, in log size)."""
        s = self.sizes
        x = min(max(float(x), s[0]), s[-1])
        i = min(bisect_right(s, x) - 1, len(s) - 2)
        return i, (math.log(x) - math.log(s[i])) / (math.log(s[i + 1]) - math.log(s[i]))

    def __float__(self) -> float:
        return max(v for plane in self.flops_per_s for row in plane for v in row)

    def as_dict(self) -> dict:
        return {"sizes": list(self.sizes),
                "flops_per_s": [[[float(f"{v:.4g}") for v in row] for row in plane]
                                for plane in self.flops_per_s]}

    @classmethod
    def from_dict(cls, data: dict) -> MatmulCurve:
        return cls(tuple(int(s) for s in data["sizes"]),
                   tuple(tuple(tuple(float(v) for v in row) for row in plane)
                         for plane in data["flops_per_s"]))

    @classmethod
    def flat(cls, flops_per_s: float) -> MatmulCurve:
        """One rate for every shape (what a plain number means)."""
        return cls((1, 2), ((((flops_per_s,) * 2,) * 2,) * 2))


def seconds_of(rate, m: float, k: float, n: float, count: float = 1.0) -> float:
    """Time of `count` (m x k) @ (k x n) products at `rate`: a MatmulCurve or one FLOP/s."""
    if isinstance(rate, MatmulCurve):
        return rate.seconds(m, k, n, count)
    return count * 2.0 * m * k * n / float(rate)


def measure(device=None, sizes: tuple[int, ...] | None = None, dtype=None,
            min_seconds: float = 0.02) -> MatmulCurve:
    """Time every (m, k, n) of the grid on `device` (default the CPU, on one thread, as a rank
    computes: training ranks share the host's cores), each repeated until `min_seconds`
    have passed."""
    import torch

    device = torch.device(device or "cpu")
    dtype = dtype or torch.float32
    sizes = sizes or (SIZES if device.type == "cpu" else (256, 1024, 4096, 8192))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        grid = [[[_time(torch, device, dtype, m, k, n, min_seconds) for n in sizes]
                 for k in sizes] for m in sizes]
    finally:
        torch.set_num_threads(threads)
    return MatmulCurve(tuple(sizes), tuple(tuple(tuple(r) for r in p) for p in grid))


def _time(torch, device, dtype, m: int, k: int, n: int, min_seconds: float) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    a @ b
    sync(device)
    repeats, elapsed = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return 2.0 * m * k * n * repeats / elapsed
        repeats *= 2
