"""TorchRec as a peer system in `tilework bench`: the recommender workload's DLRM, trained with
its tables sharded by TorchRec's DistributedModelParallel on CPU (gloo).

Two systems: "torchrec" (the sharding TorchRec's planner chooses among what it offers on CPU:
data-parallel, table-wise, column-wise) and "torchrec-rw" (every table row-wise; upstream offers
row-wise only on CUDA, `CpuRowWiseSharder` enables it on CPU). Same model as the other systems:
the tilework DLRM built from the same seed lends its bottom and top MLPs and its table weights.
Same optimizer: plain SGD, lr 0.01 -- torch.optim.SGD on the dense layers (all-reduced by
TorchRec's DDP wrapper) and, on the tables, SGD fused into the embedding backward
(`apply_optimizer_in_backward(torch.optim.SGD)`, fbgemm's EXACT_SGD on sparse rows).

torchrec is optional (`pip install 'tilework[bench]'`, then torchrec itself with --no-deps; see
README) and imported only here, lazily.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.wire import all_gather_bytes, all_to_all_bytes, ring_allreduce_bytes

SYSTEMS = ("torchrec", "torchrec-rw")
WORKLOADS = ("recommender",)
LR = 0.01
MISSING = "torchrec is not installed: pip install 'tilework[bench]' (see README)"


def missing() -> str | None:
    """None when torchrec and fbgemm-gpu import; else the line that says how to install them."""
    import importlib

    try:
        for name in ("fbgemm_gpu", "torchrec"):
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - an ImportError or a broken native library alike
        return f"{MISSING} ({type(e).__name__}: {e})"
    return None


def refuse(workload: str) -> str | None:
    if workload not in WORKLOADS:
        return f"torchrec systems run the recommender workload only, not {workload!r}"
    return None


class _TorchRecDLRM(nn.Module):
    """The tilework DLRM with its tables replaced by one TorchRec EmbeddingBagCollection (sum of
    a one-id bag = the row)."""

    def __init__(self, src: nn.Module, ebc: nn.Module):
        super().__init__()
        self.ebc, self.bottom, self.top = ebc, src.bottom, src.top
        self.keys = [f"f{i}" for i in range(len(src.tables))]

    def forward(self, dense, ids, labels):
        from torchrec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys, values=ids.t().reshape(-1),
            lengths=torch.ones(ids.numel(), dtype=torch.int64, device=ids.device))
        rows = self.ebc(kjt).to_dict()
        from ..models import DLRM

        # DLRM.score reads only self.top: the same interaction and head as the tilework model.
        return DLRM.score(self, self.bottom(dense), [rows[k] for k in self.keys], labels)


def _ebc(src: nn.Module):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    return EmbeddingBagCollection(device=torch.device("cpu"), tables=[
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=t.num_embeddings,
                           embedding_dim=t.embedding_dim, pooling=PoolingType.SUM)
        for i, t in enumerate(src.tables)])


def _sharder_class():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class CpuRowWiseSharder(EmbeddingBagCollectionSharder):
        """Upstream lists row-wise for CUDA only; its CPU kernels run it as they are."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            rw = ShardingType.ROW_WISE.value
            return types if rw in types else types + [rw]

    return CpuRowWiseSharder


def _plan(model: nn.Module, sharder, tables: int, row_wise: bool, world_size: int):
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )

    constraints = {f"t{i}": ParameterConstraints(sharding_types=["row_wise"])
                   for i in range(tables)} if row_wise else None
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints)
    return planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)


def _copy_tables(model: nn.Module, weights: list[torch.Tensor]) -> None:
    """Sharding builds fresh (randomly initialised) kernels: write the source rows into this
    rank's shards through the state dict's views."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if ".embedding_bags." not in key or not key.endswith(".weight"):
                continue
            full = weights[int(key.split(".")[-2][1:])]
            if not hasattr(value, "local_shards"):      # data-parallel: a replicated tensor
                value.copy_(full)
                continue
            for shard in value.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r:r + h, c:c + w])


def _sharding(plan) -> str:
    """'t0:table_wise@1; t1:row_wise@0,1' -- what each table got, on which ranks."""
    parts = []
    for module_plan in plan.plan.values():
        for name, p in sorted(module_plan.items()):
            parts.append(f"{name}:{p.sharding_type}@{','.join(map(str, p.ranks or []))}")
    return "; ".join(parts)


def _optimizer(model: nn.Module, lr: float):
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=lr))
    return CombinedOptimizer([model.fused_optimizer, dense])


class ByteCounter:
    """What this rank sent in TorchRec's collectives during a step: the all-to-all, reduce-scatter
    and all-gather calls torchrec makes (wrapped on torch.distributed, which it calls through),
    plus a ring all-reduce of the gradients of every DDP-wrapped parameter (dense layers and any
    data-parallel table), counted from their sizes -- DDP's reducer calls gloo from C++."""

    def __init__(self, model: nn.Module, world_size: int):
        self.world_size, self.sent = world_size, 0
        ddp = [m for m in model.modules() if isinstance(m, nn.parallel.DistributedDataParallel)]
        dense = sum(p.numel() * p.element_size() for m in ddp for p in m._module_parameters
                    if p.requires_grad)
        self.dense = ring_allreduce_bytes(dense, world_size)
        self._originals = {}

    def _count(self, name: str, args, kwargs) -> None:
        n, rank = self.world_size, dist.get_rank()
        if name == "all_to_all_single":
            tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
            nbytes = tensor.numel() * tensor.element_size()
            if splits:
                row = nbytes // max(tensor.shape[0], 1)
                self.sent += row * (sum(splits) - splits[rank])
            else:
                self.sent += all_to_all_bytes(nbytes, n)
            return
        tensor = args[1] if len(args) > 1 else next(
            kwargs[k] for k in ("input", "input_list", "input_tensor", "tensor") if k in kwargs)
        parts = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        if name.startswith("reduce_scatter"):
            self.sent += all_to_all_bytes(nbytes, n)      # ring reduce-scatter: n - 1 chunks
        else:
            self.sent += all_gather_bytes(nbytes, n)

    def install(self) -> "ByteCounter":
        for name in ("all_to_all_single", "reduce_scatter", "reduce_scatter_tensor",
                     "all_gather", "all_gather_into_tensor"):
            original = self._originals[name] = getattr(dist, name)

            def wrapped(*args, _name=name, _original=original, **kwargs):
                self._count(_name, args, kwargs)
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def take(self) -> int:
        """This step's bytes (the counted collectives since the last take, plus the dense ring)."""
        sent, self.sent = self.sent, 0
        return sent + self.dense


def setup(workload, system: str, world_size: int, lr: float = LR):
    """(model, optimizer, counter, info) for one rank: `model(*workload.batch(...))` is the loss,
    `optimizer.step()` the dense update (the tables' SGD already ran in the backward)."""
    import logging

    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    for name in ("torchrec", "root"):     # its planner's advice on GPU topologies, every run
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.manual_seed(0)
    src = workload.make(True)           # the tilework model every other system starts from
    weights = [t.weight.detach().clone() for t in src.tables]
    model = _TorchRecDLRM(src, _ebc(src))
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": lr})
    if system == "torchrec-rw":
        sharder = _sharder_class()()
    else:                               # upstream's sharder, as it is on CPU
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        sharder = EmbeddingBagCollectionSharder()
    plan = _plan(model, sharder, len(weights), system == "torchrec-rw", world_size)
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder])
    _copy_tables(model, weights)
    info = {"sharding": _sharding(plan), "embedding_optimizer": "fused SGD (fbgemm EXACT_SGD)"}
    return model, _optimizer(model, lr), ByteCounter(model, world_size).install(), info
