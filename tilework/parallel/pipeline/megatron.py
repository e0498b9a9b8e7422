"""The simulator at paper scale: Megatron-LM's weak-scaling runs (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21, Table 1) replayed
through pipeline.simulate, beside the published throughput. Pure: docs/pipeline.md prints it.

Per stage, per microbatch of b sequences of s tokens (hidden h, vocabulary V, t-way tensor
parallel): a layer's forward is 24bsh^2 + 4bs^2h FLOPs split over t GPUs plus two all-reduces of
its b*s*h fp16 activation inside the node (Megatron's f and g); its backward recomputes the
forward (activation recompute, as the paper's runs do) and then takes twice the forward, with
two more all-reduces per pass: 3x the FLOPs and 4 all-reduces. The last stage adds the logits,
2bshV forward and 4bshV backward. Between stages goes b*s*h*2 / t bytes per GPU (the paper's
scatter/gather over the node's InfiniBand cards). After the pipeline, the data-parallel ring
all-reduce of the stage's fp16 gradients over d nodes, not overlapped. Throughput counts
FLOPs as the paper does: 96 B s l h^2 (1 + s / 6h + V / 16lh) per step (recompute included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...cluster.topology import Link
from ...comm.wire import ALL_REDUCE, ring_allreduce_bytes
from ...estimate.cost import seconds
from .schedule import Schedule, interleaved_1f1b, one_f_one_b
from .simulate import simulate

SEQ, VOCAB = 2048, 51200    # every Table 1 model (paper, sec. 5.1; Megatron-LM's README)


@dataclass(frozen=True)
class Run:
    """One row of Table 1: model, parallel degrees, batch, and the published throughput."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    tflops: float           # achieved teraFLOP/s per GPU, as published

    @property
    def d(self) -> int:
        return self.gpus // (self.t * self.p)


# Narayanan et al. 2021, Table 1 (weak scaling on Selene, 80 GB A100s, 8 per node). Each row
# reproduces its published aggregate PFLOP/s (tflops x gpus) within rounding.
TABLE1 = (
    Run(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Run(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Run(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Run(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Run(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Run(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Run(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Run(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Run(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Run(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


@dataclass(frozen=True)
class Hardware:
    """Assumptions, not measurements: an A100 node (DGX A100 as on Selene)."""

    flops: float = 150e12        # sustained FLOP/s of a layer's work per GPU (see `calibrate`)
    # NVLink 3: 12 links x 25 GB/s each way = 300 GB/s per GPU; ~5 us per ring step
    nvlink: Link = field(default_factory=lambda: Link(bandwidth_gbps=2400.0, latency_us=5.0))
    # one 200 Gb/s HDR InfiniBand card per GPU; ~5 us per message
    infiniband: Link = field(default_factory=lambda: Link(bandwidth_gbps=200.0, latency_us=5.0))


def model_flops(run: Run) -> float:
    """FLOPs of one step as the paper counts them (its eq. 3, activation recompute included)."""
    b, s, l, h, v = run.batch, SEQ, run.layers, run.hidden, VOCAB
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _allreduce_s(nbytes: int, n: int, link: Link) -> float:
    return 0.0 if n == 1 else seconds(ring_allreduce_bytes(nbytes, n), link, ALL_REDUCE.messages(n))


def stage_seconds(run: Run, schedule: Schedule, hw: Hardware, micro: int = 1
                  ) -> tuple[list[float], list[float]]:
    """Per stage (schedule.stages of them, layers split evenly), forward and backward seconds of
    one microbatch of `micro` sequences on one GPU of its t-way group."""
    b, s, h, t = micro, SEQ, run.hidden, run.t
    per_stage = run.layers / schedule.stages
    layer = (24 * b * s * h * h + 4 * b * s * s * h) / t / hw.flops
    ar = _allreduce_s(b * s * h * 2, t, hw.nvlink)
    fwd = [per_stage * (layer + 2 * ar)] * schedule.stages
    bwd = [per_stage * (3 * layer + 4 * ar)] * schedule.stages
    logits = 2 * b * s * h * VOCAB / t / hw.flops
    fwd[-1] += logits
    bwd[-1] += 2 * logits
    return fwd, bwd


def predict(run: Run, hw: Hardware, v: int = 1, micro: int = 1) -> dict:
    """Simulated step of `run` with 1F1B (v = 1) or interleaved 1F1B (v chunks per GPU): its
    seconds, pipeline bubble and teraFLOP/s per GPU."""
    m = run.batch // (run.d * micro)
    schedule = one_f_one_b(run.p, m) if v == 1 else interleaved_1f1b(run.p, m, v)
    fwd, bwd = stage_seconds(run, schedule, hw, micro)
    sim = simulate(schedule, fwd, bwd, hw.infiniband, micro * SEQ * run.hidden * 2 // run.t)
    grads = 2 * int(run.params_b * 1e9) // (run.t * run.p)        # fp16, this GPU's share
    step = sim.step_s + _allreduce_s(grads, run.d, hw.infiniband)
    return {"step_s": step, "bubble": sim.bubble, "m": m,
            "tflops": model_flops(run) / step / run.gpus / 1e12}


def calibrate(run: Run, hw: Hardware) -> Hardware:
    """The Hardware whose `flops` makes `run`'s prediction equal its published throughput
    (bisection; the prediction grows with flops): the stand-in for `tilework calibrate`'s
    measured FLOP/s, which no A100 here can give."""
    lo, hi = 1e12, 1e15
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if predict(run, Hardware(mid, hw.nvlink, hw.infiniband))["tflops"] < run.tflops:
            lo = mid
        else:
            hi = mid
    return Hardware((lo * hi) ** 0.5, hw.nvlink, hw.infiniband)


def chunks(run: Run) -> int:
    """Stages per GPU for the interleaved schedule: 2 where each GPU's layers split in two, 3
    where they split in three, else 1 (interleaving needs whole layers per chunk)."""
    per_gpu = run.layers // run.p
    return next((v for v in (2, 3) if run.p > 1 and per_gpu % v == 0), 1)


def table(hw: Hardware | None = None) -> list[dict]:
    """Every Table 1 row beside its prediction, 1F1B and interleaved, with `hw` (default: the
    compute rate calibrated on the first row, which has no tensor or pipeline parallelism)."""
    hw = hw or calibrate(TABLE1[0], Hardware())
    rows = []
    for run in TABLE1:
        plain, v = predict(run, hw), chunks(run)
        inter = predict(run, hw, v) if v > 1 else plain
        rows.append({"run": run, "d": run.d, "m": plain["m"], "v": v, "hw_tflops": hw.flops / 1e12,
                     "1f1b": plain, "interleaved": inter})
    return rows
