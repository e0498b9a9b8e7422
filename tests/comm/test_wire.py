"""The wire table is what the counted collectives record: one definition of bytes per call."""

import torch
import torch.distributed as dist

from tilework.comm import wire
from tilework.comm.counted import Stats, all_gather, all_reduce, all_to_all_v
from tilework.testing import spawn


def _counted(rank, world_size):
    stats = Stats()
    buf = torch.ones(12, device="cpu")
    all_reduce(buf.clone(), dist.group.WORLD, stats, "all_reduce")
    all_gather(buf.clone(), dist.group.WORLD, stats, "all_gather")
    all_to_all_v(list(buf.clone().chunk(world_size)), dist.group.WORLD, stats, "all_to_all")
    return {k: (v.sent, v.calls) for k, v in stats.total.items()}


def test_counters_record_the_wire_tables_bytes():
    n, nbytes = 3, 12 * 4
    out = spawn(_counted, world_size=n, timeout=60)
    expected = {"all_reduce": (wire.ALL_REDUCE.sent(nbytes, n), 1),
                "all_gather": (wire.ALL_GATHER.sent(nbytes, n), 1),
                # lengths first, then the evenly split payload
                "all_to_all": (wire.count_exchange_bytes(n) + wire.ALL_TO_ALL.sent(nbytes, n), 2)}
    assert all(out[r] == expected for r in range(n)), out


def test_one_rank_sends_nothing():
    for c in wire.COLLECTIVES.values():
        if c.name != "send_recv":
            assert c.sent(1 << 20, 1) == 0, c.name
    assert wire.count_exchange_bytes(1) == 0 and wire.input_check_bytes(1) == 0
