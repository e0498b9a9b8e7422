"""estimate/outer_memory.py: the codec's temporaries it counts are what MemTracker measures of
comm/codec.py, and what a sync holds follows its schedule (the peak against real runs is in
test_memory.py's local-SGD test)."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from tilework import ParallelConfig
from tilework.comm.codec import decode, encode, encoded_bytes


def _peak_beyond(fn, *inputs) -> tuple[int, torch.Tensor]:
    tracker = MemTracker()
    tracker.track_external(*inputs)
    with tracker:
        out = fn()
    cpu = torch.device("cpu")
    held = sum(t.numel() * t.element_size() for t in inputs)
    return tracker.get_tracker_snapshot("peak")[cpu]["Total"] - held, out


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_the_codec_temporaries_are_measured(codec):
    from tilework.estimate.outer_memory import DECODE_TEMPS, ENCODE_TEMPS

    rows, k = 2, 64 * 1024
    x = torch.randn(rows, k)
    peak, sent = _peak_beyond(lambda: encode(x, codec), x)
    assert sent.numel() == rows * encoded_bytes(k, codec)
    assert peak - sent.numel() == pytest.approx(ENCODE_TEMPS[codec] * rows * k, rel=1e-3)
    peak, back = _peak_beyond(lambda: decode(sent, codec, k), sent)
    assert peak - back.numel() * 4 == pytest.approx(DECODE_TEMPS[codec] * rows * k, rel=1e-3)


def _plan(sync="diloco", **options):
    from tilework.cluster.topology import Topology
    from tilework.models.gpt import TinyGPT
    from tilework.planner import plan as make_plan

    torch.manual_seed(0)
    model = TinyGPT(vocab=2000, dim=128, heads=4, layers=4, seq_len=32)
    config = ParallelConfig(mode="allreduce", sync=sync, check_inputs=False, **options)
    return make_plan(model, config, topology=Topology.from_sizes([2]))


def test_only_an_exchange_that_outlives_its_step_is_held_between_steps():
    from tilework.estimate.outer_memory import outer_sync_memory

    plain = outer_sync_memory(_plan(sync_every=4, outer_compress="int8"))
    assert plain.in_flight == 0 and plain.transient > 0
    streamed = outer_sync_memory(_plan(sync_every=4, outer_fragments=2, outer_delay=1,
                                       outer_compress="int8"))
    # Half the model in flight (what it sends and receives, what the feedback owed), and the
    # sync's own excess over that smaller than the whole model's sync.
    assert streamed.in_flight > 0 and streamed.transient < plain.transient
    layerwise = outer_sync_memory(_plan(sync_every=4, outer_schedule="layerwise"))
    assert layerwise.in_flight > 0


def test_a_worker_of_one_rank_keeps_no_all_reduce_buckets():
    """Local SGD with one rank a worker all-reduces nothing between syncs (runtime/engine.py
    hands the dense sync no parameters), so its estimate holds no bucket copies."""
    from tilework.estimate.memory import zero_figures

    assert zero_figures(_plan(sync_every=2), 2, 4).buckets == 0
    assert zero_figures(_plan(sync="every_step"), 2, 4).buckets > 0
