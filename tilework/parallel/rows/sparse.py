"""The parameter server, built from collectives: tables whose rows are served by their owners.

A table's rows are partitioned over ranks (see plans/rows.py); a rank holds only its shard and the
row-wise optimizer state for it. Per step:

- pull (forward): a rank de-duplicates its ids and fetches those rows from their owners;
- push (end of backward): it sends unique ids and summed gradient rows to the owners, every
  table in one exchange (parallel/rows/exchange.py); the owners sum what arrives, and the optimizer
  step applies the row-wise optimizer.

Both travel a list of hops, each an all-to-all inside one process group. Direct: one hop over the
world. With local aggregation: first to the rank of this host that shares the owner's local index
(intra-host group), which merges duplicate rows from its host, then across hosts to the owner
(inter-host group), so a row crosses the inter-host network at most once per host per step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.counted import Stats, all_gather, all_to_all_v, gather
from ...comm.guard import CallGuard
from ...errors import PlanError, use_allreduce_hint
from ...optim.own import take_rows
from ...optim.rowwise import RowOptimizer
from ...plans.plan import ParamPlan
from ...plans.rows import TableLayout, routes
from ..data.checks import check_ids
from .hot import HotHead
from .lookups import Batch, Lookup

UNGUARDED = CallGuard(None, 0, 1)


@dataclass(frozen=True)
class Hop:
    group: object                                   # a ProcessGroup, or None for one rank
    dest: Callable[[torch.Tensor], torch.Tensor]    # ids -> group rank to send each id to
    remote: list[bool]                              # group rank j is on another host


def hops_for(layout: TableLayout, groups, local_aggregation: bool) -> list[Hop]:
    """layout.routes bound to this rank's process groups."""
    topo, me = groups.topology, groups.rank
    hops = []
    for route in routes(layout, topo, local_aggregation):
        members = next(g for g in route.groups if me in g)
        hops.append(Hop(getattr(groups, route.axis), route.dest,
                        [topo.host_of(r) != topo.host_of(me) for r in members]))
    return hops


def _by_destination(dest: torch.Tensor, n: int):
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=n).tolist()
    return order, counts


class PSTable:
    """One table on the parameter server: this rank's shard, its optimizer, the pending grads."""

    def __init__(self, plan: ParamPlan, full: torch.Tensor, groups, stats: Stats,
                 local_aggregation: bool, reduce: str, make_optimizer):
        self.name, self.plan, self.groups, self.stats = plan.name, plan, groups, stats
        self.layout = TableLayout(plan, groups.world_size, device=full.device)
        self.hops = hops_for(self.layout, groups, local_aggregation)
        self.scale = 1.0 / groups.world_size if reduce == "mean" else 1.0
        rows = self.layout.shard_rows(groups.rank)
        self.global_rows = rows
        self.shard = full.detach().reshape(full.shape[0], -1)[rows].clone()
        # The width its gradient rows cross in on the push (ParamPlan.push_dtype).
        self.push_dtype = getattr(torch, plan.push_dtype) if plan.push_dtype \
            else self.shard.dtype
        self.row_shape = full.shape[1:]
        self.optimizer: RowOptimizer = make_optimizer(self.shard)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # this rank's, global ids
        self.pulls: list = []   # routes of this step's pulls (exchange.PullRoute), for the push
        # capacities of the pull's id blocks (exchange._send_ids), for the exchanges this table
        # leads: {(tables, hop): (to each peer, from each peer)}
        self.id_blocks: dict[tuple, tuple[list[int], list[int]]] = {}
        self.received: tuple[torch.Tensor, torch.Tensor] | None = None  # owned rows, local index
        # the engine's trigger (end of backward queued; parallel/rows/push.py's EarlyPush)
        self.on_grad: Callable[[PSTable], object] | None = None
        self.guard = UNGUARDED                            # the engine's CallGuard
        # rows [0, hot_rows) replicated here, all-reduced (parallel/rows/hot.py); the servers keep
        # theirs unused until a checkpoint is gathered, which takes the head's
        self.head = HotHead(plan, full, groups, stats, self.scale, make_optimizer) \
            if plan.hot_rows else None

    # -- push (end of a synchronised backward) and apply (optimizer step) ------------------------
    def accumulate(self, ids: torch.Tensor, grad_rows: torch.Tensor) -> None:
        """One lookup's gradient rows for its unique (sorted) ids: the head's rows to the head,
        the rest pending for the servers."""
        grad_rows = grad_rows.reshape(len(ids), -1)
        if self.head is not None:
            k = self.hot_count(ids)
            self.head.accumulate(ids[:k], grad_rows[:k])
            ids, grad_rows = ids[k:], grad_rows[k:]
        self.pending.append((ids, grad_rows))
        if self.on_grad is not None:
            self.on_grad(self)

    def hot_count(self, ids: torch.Tensor) -> int:
        """How many of the sorted `ids` are head rows (they come first)."""
        return 0 if self.head is None else int((ids < self.head.rows).sum())

    def gradients(self) -> list[torch.Tensor]:
        """The gradient rows this rank holds for the table (for the input checks)."""
        return [g for _, g in self.pending] + ([self.head.grad] if self.head is not None else [])

    def coalesce(self) -> None:
        """Merge pending rows by id: backward passes without sync never hold more than one row
        per id, however many there are."""
        if len(self.pending) > 1:
            self.pending = [_merge_rows(self.pending, self.shard.shape[1], self.shard.dtype)]

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's gradient rows, merged by id and scaled (mean or sum over ranks), for the
        push (parallel/rows/exchange.py); nothing is pending afterwards."""
        if self.pending:
            ids, grads = _merge_rows(self.pending, self.shard.shape[1], self.shard.dtype)
            grads.mul_(self.scale)
        else:
            ids = torch.empty(0, dtype=torch.long, device=self.shard.device)
            grads = self.shard.new_empty(0, self.shard.shape[1])
        self.pending = []
        return ids, grads

    def receive(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Rows the push brought to this owner (global ids), summed into `received`."""
        rows = self.layout.local_index(ids)
        if self.received is not None:
            rows, grads = _merge_rows([self.received, (rows, grads)], grads.shape[1], grads.dtype)
        self.received = (rows, grads)

    def apply(self) -> None:
        """The optimizer step on this rank's rows: local, counts one step even with no rows."""
        rows, grads = self.received if self.received is not None else (
            torch.empty(0, dtype=torch.long, device=self.shard.device),
            self.shard.new_empty(0, self.shard.shape[1]))
        self.received = None
        self.optimizer.apply(rows, grads)
        if self.head is not None:
            self.head.apply()

    def discard(self) -> None:
        self.pending, self.received, self.pulls = [], None, []
        if self.head is not None:
            self.head.discard()

    def received_grads(self) -> torch.Tensor | None:
        """This rank's rows of the summed gradient (for clipping), or None."""
        return None if self.received is None else self.received[1]

    # -- whole-table views (checkpoints, evaluation) --------------------------------------------
    def gather(self, local: torch.Tensor, dst: int | None) -> torch.Tensor | None:
        """The whole table of `local`, a tensor with one entry per shard row: the shard, or a
        row-wise optimizer state (a user's optimizer may keep one scalar per row)."""
        full = gather_rows(_by_rows(local), self.layout, self.groups, dst, self.stats)
        if full is None:
            return None
        twin = None if self.head is None else self.head.twin(self, local)
        if twin is not None:   # the head's rows are the replicated ones
            full[:self.head.rows] = twin.reshape(self.head.rows, -1)
        trailing = self.row_shape if local.shape[1:] == self.shard.shape[1:] else local.shape[1:]
        return full.reshape(self.layout.rows, *trailing)

    def take_shard(self, full: torch.Tensor) -> torch.Tensor:
        # A checkpoint may be loaded onto another device than the table's.
        return full.reshape(full.shape[0], -1)[self.global_rows.to(full.device)]

    def load_rows(self, full: torch.Tensor) -> None:
        """The table's rows from a whole table (a checkpoint), the head's too."""
        with torch.no_grad():
            self.shard.copy_(self.take_shard(full))
            if self.head is not None:
                self.head.weight.copy_(full.reshape(full.shape[0], -1)[:self.head.rows])

    def load_optimizer(self, step: int, full: dict[str, torch.Tensor]) -> None:
        """Row-wise optimizer state from whole tables, the head's too."""
        self.optimizer.load(step, take_rows(full, self.layout.rows, self.take_shard))
        if self.head is not None:
            self.head.load(step, full, self.layout.rows)

    def shard_bytes(self) -> int:
        tensors = [self.shard, *self.optimizer.state_tensors().values()]
        head = self.head.nbytes() if self.head is not None else 0
        return sum(t.numel() * t.element_size() for t in tensors) + head


def _by_rows(local: torch.Tensor) -> torch.Tensor:
    """`local` as (rows, width): an owner of no rows has a width too."""
    return local.reshape(len(local), local.shape[1:].numel())


def _merge_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], width: int, dtype):
    """(ids, rows) pairs -> unique ids and their summed rows."""
    ids, inverse = torch.unique(torch.cat([i for i, _ in parts]), return_inverse=True)
    rows = torch.zeros(len(ids), width, dtype=dtype, device=ids.device)
    rows.index_add_(0, inverse, torch.cat([g for _, g in parts]))
    return ids, rows


def gather_rows(local: torch.Tensor, layout: TableLayout, groups, dst: int | None,
                stats: Stats):
    """The full (rows x width) table assembled from every rank's shard `local`: on rank `dst`
    only (None elsewhere), or on every rank when dst is None. A collective, counted as
    "gather"."""
    n = groups.world_size
    full = local.new_empty(layout.rows, local.shape[1])
    if n == 1:
        full[layout.shard_rows(0)] = local
        return full
    width = max(layout.shard_sizes)
    padded = local.new_zeros(width, local.shape[1])
    padded[: len(local)] = local
    if dst is None:
        parts = all_gather(padded, groups.world, stats, "gather")
    else:
        parts = gather(padded, dst, groups.world, stats, "gather")
        if parts is None:
            return None
    for r in range(n):
        full[layout.shard_rows(r)] = parts[r][: layout.shard_sizes[r]]
    return full


class ShardedEmbedding(nn.Module):
    """Stands in for an nn.Embedding / nn.EmbeddingBag whose table lives on the servers."""

    def __init__(self, table: PSTable, original: nn.Module, lookups: Batch):
        super().__init__()
        if getattr(original, "max_norm", None) is not None:
            raise PlanError(f"{table.name}: max_norm renormalises rows in place during lookup, "
                            "which the parameter server does not do; drop max_norm, or "
                            f"all-reduce this table: {use_allreduce_hint(table.name)}")
        self.table, self.lookups = table, lookups
        self.bag = isinstance(original, nn.EmbeddingBag)
        self.padding_idx = original.padding_idx
        self.mode = getattr(original, "mode", None)
        self.include_last_offset = getattr(original, "include_last_offset", False)
        self.num_embeddings, self.embedding_dim = original.num_embeddings, original.embedding_dim
        self.gather_to: int | str | None = None  # state_dict: every rank, one rank, or "meta"

    def forward(self, input: torch.Tensor, offsets=None, per_sample_weights=None):
        """The output at once as a stand-in; its rows come with the batch's pull
        (parallel/rows/lookups.py)."""
        flat = input.reshape(-1)
        # Before the pull: a bad id stops this rank here, not inside the owners' lookup.
        check_ids(self.table.name, flat, self.num_embeddings, self.table.groups.rank)
        ids, inverse = torch.unique(flat, return_inverse=True)
        hot = self.table.hot_count(ids)   # head rows: read here, not pulled
        pad = None
        if self.padding_idx is not None:
            hit = (ids == self.padding_idx).nonzero()
            pad = int(hit[0]) if len(hit) else None
        local = inverse.reshape(input.shape)

        def finish(rows: torch.Tensor) -> torch.Tensor:
            if hot:
                rows = torch.cat([self.table.head.weight[ids[:hot]], rows])
            if torch.is_grad_enabled():
                rows.requires_grad_(True)
                # The table held weakly: torch keeps a leaf's hooks in its C++ autograd state,
                # which a kept output's graph reaches (runtime/hooks.post_accumulate_grad_hook).
                table = weakref.ref(self.table)
                rows.register_hook(lambda g: table().accumulate(ids, g))
            if self.bag:
                return F.embedding_bag(local, rows, offsets, mode=self.mode,
                                       per_sample_weights=per_sample_weights,
                                       include_last_offset=self.include_last_offset,
                                       padding_idx=pad)
            return F.embedding(local, rows, padding_idx=pad)

        # Tables served in one hop may have had this lookup's route sent ahead
        # (parallel/rows/ahead.py).
        key = self.lookups.ahead.key_of(input) if len(self.table.hops) == 1 else None
        lookup = Lookup(self.table, ids[hot:], finish, torch.is_grad_enabled(),
                        torch.is_inference_mode_enabled(), key)
        return self.lookups.add(lookup, self._output_like(input, offsets))

    def _output_like(self, input: torch.Tensor, offsets) -> torch.Tensor:
        """A tensor with the output's metadata and no memory of its own."""
        if not self.bag:
            shape = (*input.shape, self.embedding_dim)
        elif input.dim() == 2:
            shape = (input.shape[0], self.embedding_dim)
        else:
            shape = (len(offsets) - int(self.include_last_offset), self.embedding_dim)
        return self.table.shard.new_zeros(()).expand(shape)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, gathered from every rank: a collective, and for evaluation only."""
        if torch.is_grad_enabled():
            raise PlanError(f"{self.table.name} is sharded over the parameter servers: reading "
                            ".weight gathers a copy that cannot train; use it under "
                            "torch.no_grad(), or look rows up by calling the module")
        return self.table.gather(self.table.shard, dst=None)

    # -- the user's own checkpoints: model.state_dict() / load_state_dict() -----------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The whole table under its own key, in single-device layout: gathered from every rank
        (a collective: every rank calls model.state_dict() together)."""
        table = self.table
        if self.gather_to == "meta":
            destination[prefix + "weight"] = torch.empty(table.plan.shape, dtype=table.shard.dtype,
                                                         device="meta")
            return
        with table.guard.call(f"model.state_dict(), which gathers {table.name}"):
            destination[prefix + "weight"] = table.gather(table.shard, self.gather_to)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key, shape = prefix + "weight", tuple(self.table.plan.shape)
        for other in state_dict:
            if other.startswith(prefix) and other != key and "." not in other[len(prefix):]:
                unexpected_keys.append(other)
        if key not in state_dict:
            missing_keys.append(key)
            return
        value = state_dict[key]
        if not torch.is_tensor(value) or tuple(value.shape) != shape:
            got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {got} from "
                              f"checkpoint, the shape in current model is {shape}.")
            return
        self.lookups.flush()   # lookups made before the load read the rows before it
        self.table.load_rows(value.detach())

    def __reduce_ex__(self, protocol):
        raise PlanError(f"torch.save(model) cannot save {self.table.name}: its rows are spread "
                        "over the ranks; use tilework.save(path, model, optimizer), or "
                        "torch.save(model.state_dict(), path) called on every rank")

    def extra_repr(self) -> str:
        hot = f", hot_rows={self.table.head.rows}" if self.table.head is not None else ""
        return (f"{self.num_embeddings}, {self.embedding_dim}, partitions="
                f"{self.table.plan.partitions}, shard_rows={len(self.table.global_rows)}{hot}")


class DenseServed:
    """A dense parameter synchronised through the servers (mode="ps"): every row, every step.

    Each rank keeps a full replica to compute with; owners hold the optimizer state of their
    rows. Push sends every owner its rows of the gradient (a reduce-scatter), pull sends every
    rank each owner's updated rows (an all-gather); no ids travel, since all rows always do.
    """

    def __init__(self, plan: ParamPlan, param: nn.Parameter, groups, stats: Stats, make_optimizer):
        self.name, self.param, self.groups, self.stats = plan.name, param, groups, stats
        self.layout = TableLayout(plan, groups.world_size, device=param.device)
        self.rows_of = [self.layout.shard_rows(r) for r in range(groups.world_size)]
        self.global_rows = self.rows_of[groups.rank]
        self.shard = self._view(param.detach())[self.global_rows].clone()
        self.optimizer: RowOptimizer = make_optimizer(self.shard)
        self.received: torch.Tensor | None = None  # this rank's rows of the averaged gradient
        topo = groups.topology
        self.remote = [topo.host_of(r) != topo.host_of(groups.rank) for r in range(topo.world_size)]

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.layout.rows, -1)

    def push(self) -> None:
        """End of a synchronised backward: every owner gets the sum of its rows of the gradient
        (a reduce-scatter), added to what it holds until the step. The gradient lives there
        now: `.grad` is None, so nothing else applies it."""
        grad = self.param.grad
        if grad is None:
            grad = torch.zeros_like(self.param)
        g = self._view(grad.to_dense() if grad.is_sparse else grad) / self.groups.world_size
        # Every rank always sends every owner its rows: the lengths are known, no count exchange.
        got = all_to_all_v([g[rows] for rows in self.rows_of], self.groups.world, self.stats, "ps",
                           self.remote, recv_lengths=[len(self.shard)] * self.groups.world_size)
        summed = torch.stack(got).sum(0)
        self.received = summed if self.received is None else self.received + summed
        self.param.grad = None

    def apply(self) -> None:
        grads = self.received if self.received is not None else torch.zeros_like(self.shard)
        self.received = None
        self.optimizer.apply(torch.arange(len(self.shard), device=self.shard.device), grads)

    def discard(self) -> None:
        self.received = None
        self.param.grad = None

    def received_grads(self) -> torch.Tensor | None:
        return self.received

    def pull(self) -> None:
        n = self.groups.world_size
        got = all_to_all_v([self.shard] * n, self.groups.world, self.stats, "ps", self.remote,
                           recv_lengths=[len(rows) for rows in self.rows_of])
        with torch.no_grad():
            view = self._view(self.param.data)
            for rows, part in zip(self.rows_of, got):
                view[rows] = part

    def take_shard(self, full: torch.Tensor) -> torch.Tensor:
        return self._view(full)[self.global_rows.to(full.device)]

    def gather(self, local: torch.Tensor, dst: int | None) -> torch.Tensor | None:
        """The whole of `local` (the shard, or a row-wise optimizer state: see PSTable.gather)."""
        full = gather_rows(_by_rows(local), self.layout, self.groups, dst, self.stats)
        if full is None:
            return None
        whole_rows = local.shape[1:].numel() == self.shard.shape[1]
        return full.reshape(self.param.shape if whole_rows else (self.layout.rows,
                                                                 *local.shape[1:]))
