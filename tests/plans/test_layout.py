"""Row placement is pure arithmetic: every row has exactly one owner and one slot."""

import pytest
import torch

from tilework.plans.plan import ParamPlan
from tilework.plans.rows import TableLayout


@pytest.mark.parametrize("rows, partitions, world_size",
                         [(10, 4, 4), (10, 3, 2), (7, 8, 4), (100, 5, 8)])
@pytest.mark.parametrize("row_map", ["contiguous", "hashed"])
def test_every_row_has_one_owner_and_slot(rows, partitions, world_size, row_map):
    if partitions > rows:
        partitions = rows
    layout = TableLayout(ParamPlan("t", (rows, 2), "ps", partitions, row_map), world_size)
    ids = torch.arange(rows)
    owners, slots = layout.owner_of(ids), layout.local_index(ids)
    for rank in range(world_size):
        served = layout.shard_rows(rank)
        assert len(served) == layout.shard_sizes[rank]
        assert torch.equal(owners[served], torch.full((len(served),), rank))
        assert torch.equal(slots[served], torch.arange(len(served)))
    assert sum(layout.shard_sizes) == rows
