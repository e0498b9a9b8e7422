"""ZeRO (paper 17): dense parameters whose optimizer state (stage 1), also gradients (stage 2),
also values (stage 3, parallel/data/zero3.py) are split over the ranks.

Each sharded parameter is flattened, padded with zeros to a multiple of n elements and cut into
n equal chunks; rank r owns chunk r. This is FSDP2's per-parameter sharding rather than ZeRO's
one flat buffer: every shard belongs to one parameter, so it can stand in for that parameter in
the user's own optimizer (same class, hyperparameters and param groups). Optimizers that work
element by element (SGD, Adam, AdamW, Adagrad, RMSprop, ...) then give one process's result;
the padding gets zero gradients and stays zero. Optimizers that need a whole tensor's shape
(LBFGS, Shampoo-like ones) cannot run on shards: `check_elementwise` refuses them.

- Stage 1: gradients are all-reduced as replicated ones are (parallel/data/dense.py), so `.grad`
  keeps DDP's meaning for clipping and hand-written reads; at the step each shard's `.grad` is its
  chunk of the averaged gradient. Costs DDP's bytes plus the all-gather below.
- Stage 2: gradient buckets are reduce-scattered, rank-major (chunk j of every parameter in
  the bucket goes to rank j): when `backward()` returns, each shard's `.grad` holds its chunk of
  the average and the parameter's `.grad` is None (`tilework.clip_grad_norm_` sees the shards).
  DDP's bytes in all: a reduce-scatter and an all-gather are a ring all-reduce's two halves.
- After the step, stages 1 and 2 all-gather the updated shards into the parameters, one
  collective per bucket.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ...comm.counted import Stats, all_gather_async, all_reduce_async, reduce_scatter_async
from ...errors import PlanError
from ...plans.plan import assign_buckets
from ...runtime.hooks import PicklesAsNoop, post_accumulate_grad_hook
from .offload import Offload
from .shards import Sharded, ShardedGradient, check_elementwise, padded


class _Bucket:
    def __init__(self, shards: list[Sharded], unit=None):
        self.shards, self.unit = shards, unit   # a stage-3 unit is freed once it is packed
        self.ready: set[int] = set()
        self.pending = None

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A (.., width) tensor cut into each shard's columns."""
        return list(torch.split(flat, [s.chunk for s in self.shards], dim=-1))


def _buckets(shards: list[Sharded], bucket_bytes: int) -> list[_Bucket]:
    sizes = [s.n * s.chunk * s.param.element_size() for s in shards]
    return [_Bucket([shards[i] for i in members])
            for members in assign_buckets(sizes, bucket_bytes)]


class ZeroSync:
    """The sharded dense parameters of one model (stage 3's units in parallel/data/zero3.py).
    Buckets launch in index order on every rank, as DenseSync's do."""

    def __init__(self, params: list[tuple[str, nn.Parameter, int, str | None, tuple]], groups,
                 stats: Stats, bucket_bytes: int, checks=None, on_grad=None,
                 offload: Offload | None = None, scopes: set[str] = frozenset(),
                 across_hosts: bool = True):
        self.groups, self.stats, self.checks, self.on_grad = groups, stats, checks, on_grad
        self.bucket_bytes = bucket_bytes
        topo = groups.topology
        # scope "host" (FSDP2's HSDP): shards over one host's ranks, replicated across hosts,
        # whose copies of a gradient chunk are summed by an all-reduce over the host's peers.
        if len(scopes) > 1:
            raise PlanError(f"ZeRO shards every parameter over one scope, the plan mixes "
                            f"{sorted(scopes)}")
        # Under local SGD over hosts (`across_hosts` False) the hosts' copies are not summed:
        # each host is its own replica until the outer sync.
        if "host" in scopes and topo.num_hosts > 1:
            self.shard_group = groups.intra
            self.replicas = groups.inter if across_hosts else None
            n, rank = len(topo.hosts[groups.host]), groups.local_rank
            peers = list(topo.hosts[groups.host])
        else:
            self.shard_group, self.replicas = groups.world, None
            n, rank, peers = groups.world_size, groups.rank, list(range(groups.world_size))
        self.shard_size = n
        self.averaged = n if self.replicas is None else groups.world_size   # ranks summed
        self.offload = offload or Offload("none", None, groups.rank, groups.device)
        self.late_adds: list = []   # offloaded gradient chunks to add once their copy landed
        # `counts`: each rank's elements where the plan cuts unevenly (ParamPlan.zero_chunks)
        self.shards = [Sharded(name, p, stage, rank, n, unit, self.offload.shard, counts)
                       for name, p, stage, unit, counts in params]
        self.optimizer = None
        self.by_name = {s.name: s for s in self.shards}
        self.remote = [topo.host_of(r) != groups.host for r in peers]
        self.successor_remote = topo.host_of(peers[(rank + 1) % n]) != groups.host
        self.next_bucket, self.active = 0, False
        self.units = None   # stage 3's (parallel/data/zero3.py)
        self.guard = contextlib.nullcontext   # the engine's CallGuard.call
        self.gather_to = None   # "meta": a state dict of shapes only, nothing gathered

    def _bucket(self, model: nn.Module, changes) -> None:
        """Stage 2's gradients in buckets by size, stage 3's by unit; backward's order."""
        backward_order = list(reversed(self.shards))
        self.grad_buckets = _buckets([s for s in backward_order if s.stage == 2],
                                     self.bucket_bytes)
        if any(s.stage == 3 for s in self.shards):
            from .zero3 import Units
            self.units = Units(model, [s for s in self.shards if s.stage == 3], self, changes)
            self.grad_buckets += [_Bucket(u.shards, u) for u in self.units.in_backward_order()]
        self.gather_buckets = _buckets([s for s in backward_order if s.stage in (1, 2)],
                                       self.bucket_bytes)
        self.where = {id(s.param): (b, i) for b, bucket in enumerate(self.grad_buckets)
                      for i, s in enumerate(bucket.shards)}
        handles = [s.param.register_post_accumulate_grad_hook(
                       post_accumulate_grad_hook(self._on_grad))
                   for s in self.shards if s.stage >= 2]
        changes.record("sharded parameters: post-accumulate-grad hooks (reduce-scatter buckets)",
                       lambda: [handle.remove() for handle in handles])

    @property
    def owns_gradients(self) -> bool:
        """Gradients live on the shards between backward and step (stages 2 and 3)."""
        return any(s.stage >= 2 for s in self.shards)

    # -- set-up: the optimizer and model see the shards -----------------------------------------
    def install(self, model: nn.Module, optimizer, changes, param_names: dict) -> None:
        """The shards take their parameters' places in the optimizer (state converted), and
        zeroing gradients reaches them."""
        for s in self.shards:
            param_names[id(s.shard)] = s.name
        self._bucket(model, changes)
        if optimizer is not None:
            self._swap_into(optimizer, changes)
            self.optimizer = optimizer
            self.offload.prepare(optimizer, self.shards)
        if self.units is not None:
            # The values are gathered before any module saves its entries, so a model's own
            # state-dict hooks (torchtitan's fused wqkv split by a hook) read whole values.
            changes.hook("model: state_dict pre-hook (ZeRO-3 values gathered)",
                         model.register_state_dict_pre_hook(PicklesAsNoop(self._gather_for_save)))
            changes.hook("model: state_dict post-hook (ZeRO-3 values copied, then freed)",
                         model.register_state_dict_post_hook(PicklesAsNoop(self._full_values)))
            changes.hook("model: load_state_dict pre-hook (ZeRO-3 values gathered)",
                         model.register_load_state_dict_pre_hook(
                             PicklesAsNoop(lambda *_: self.before_load())))
        if self.owns_gradients:
            changes.extend_zero_grad(model, self.discard,
                                     "model.zero_grad (also the shards' gradients)")
            changes.hook("model: forward pre-hook (ZeRO's .grad stand-ins dropped)",
                         model.register_forward_pre_hook(PicklesAsNoop(self.drop_stand_ins)))

    def _swap_into(self, optimizer, changes) -> None:
        check_elementwise(optimizer, [s.name for s in self.shards])
        swap = {id(s.param): s for s in self.shards}
        before = [list(group["params"]) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["params"] = [swap[id(p)].shard if id(p) in swap else p for p in group["params"]]
        for p in [p for p in optimizer.state if id(p) in swap]:
            optimizer.state[swap[id(p)].shard] = self.shard_state(swap[id(p)].name,
                                                                  optimizer.state.pop(p))

        def undo():
            for group, params in zip(optimizer.param_groups, before):
                group["params"] = params
            for s in self.shards:
                optimizer.state.pop(s.shard, None)

        changes.record(f"optimizer: {len(self.shards)} parameters replaced by their shards "
                       "(ZeRO)", undo)

    # -- backward: stage 2's reduce-scatter buckets ----------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if self.on_grad is not None and not self.on_grad():
            return   # a backward without sync: the parameter's .grad accumulates locally
        self.active = True
        b, i = self.where[id(p)]
        self.grad_buckets[b].ready.add(i)
        while (self.next_bucket < len(self.grad_buckets) and
               len(self.grad_buckets[self.next_bucket].ready)
               == len(self.grad_buckets[self.next_bucket].shards)):
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def _launch(self, index: int) -> None:
        # At most two buckets in flight: the one before is finished (its flat copies freed)
        # before this one is packed, or every bucket's copies would be alive at once at the
        # end of backward, twice the gradients' memory (FSDP2 bounds them the same way).
        bucket = self.grad_buckets[index]
        if index and self.grad_buckets[index - 1].pending is not None:
            self._finish(self.grad_buckets[index - 1])
        if bucket.unit is not None:
            bucket.unit.free()    # its backward is done: values freed before the packed copy
        flat = self._pack(bucket)   # the gradients themselves are freed inside
        bucket.pending = reduce_scatter_async(flat, self.shard_group, self.stats, "zero",
                                              self.remote)

    def _pack(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's gradients as one flat buffer, rank-major (chunk j of every parameter
        for rank j), checked; each `.grad` becomes a stand-in. Its own function so that no
        local keeps a gradient alive once the receive buffer is made."""
        dtype = functools.reduce(torch.promote_types, (s.param.dtype for s in bucket.shards))
        rows = torch.empty(self.shard_size, sum(s.chunk for s in bucket.shards), dtype=dtype,
                           device=bucket.shards[0].param.device)
        parts = bucket.split(rows)   # each shard's columns, written in place
        for s, part in zip(bucket.shards, parts):
            g = s.param.grad
            if g is None:
                part.zero_()
            else:
                s.rows_into(g.to_dense() if g.is_sparse else g, part)
            s.param.grad = ShardedGradient(s.param, s.name, s.stage)   # it lives in the bucket
        flat = rows.reshape(-1)
        if self.checks is not None:
            self.checks.on_gradients([(s.name, g) for s, g in zip(bucket.shards, parts)], flat)
        return flat

    def launch_rest(self) -> None:
        """End of a synchronised backward: the buckets not launched yet (zeros for parameters
        that got no gradient on this rank)."""
        if not self.active:
            return
        while self.next_bucket < len(self.grad_buckets):
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def end_backward(self) -> None:
        """Stage 3's values freed, whether the backward synchronised or not."""
        if self.units is not None:
            self.units.free_all()

    def wait(self) -> None:
        """Every shard's `.grad` gains its chunk of the averaged gradient."""
        if not self.active:
            return
        self.active, self.next_bucket = False, 0
        for bucket in self.grad_buckets:
            if bucket.pending is not None:
                self._finish(bucket)
            bucket.ready.clear()
        if self.offload.active and self.offload.on_gpu:   # the copies down have landed
            torch.cuda.current_stream(self.offload.compute).synchronize()
            for s, g in self.late_adds:   # accumulation, read only once the copy is there
                s.shard.grad.add_(g)
            self.late_adds.clear()

    def _finish(self, bucket: _Bucket) -> None:
        summed = bucket.pending.wait()
        if self.replicas is not None:   # every byte of it crosses hosts
            work = all_reduce_async(summed, self.replicas, self.stats, "zero", True)
            if work is not None:
                work.wait()
        summed.div_(self.averaged)
        bucket.pending = None
        for s, g in zip(bucket.shards, bucket.split(summed)):
            g = s.mine(g)
            if self.offload.active and self.offload.on_gpu:
                # Down to pinned host memory without stopping the host: the copy queues behind
                # the reduce-scatter and overlaps the next buckets'; `wait` synchronises once.
                g = g.to(s.shard.device, non_blocking=True)
                if s.shard.grad is None:
                    s.shard.grad = g
                else:
                    self.late_adds.append((s, g))
                continue
            g = g.to(s.shard.device)
            s.shard.grad = g if s.shard.grad is None else s.shard.grad.add_(g)

    # -- the step --------------------------------------------------------------------------------
    def before_step(self) -> None:
        """Stage 1: each shard's gradient is its chunk of the all-reduced one."""
        for s in self.shards:
            if s.stage == 1:
                g = s.param.grad
                s.shard.grad = None if g is None else s.take(g.to_dense() if g.is_sparse else g)

    def after_step(self) -> None:
        """Stages 1 and 2: the updated shards all-gathered into the parameters; stage 3's
        values, now stale where gathered, freed (the next forward gathers them)."""
        if self.units is not None:
            self.units.free_all()
        if self.optimizer is not None:
            self.offload.settle(self.optimizer, self.shards)
        # Pipelined, two buckets in flight: the next one's gather travels while this one's
        # values are copied out, and only two buckets' gathered copies exist at once.
        buckets = self.gather_buckets
        if buckets:
            buckets[0].pending = self.gather_async(buckets[0].shards)
        for k, bucket in enumerate(buckets):
            if k + 1 < len(buckets):
                buckets[k + 1].pending = self.gather_async(buckets[k + 1].shards)
            pending, bucket.pending = bucket.pending, None
            self.write_gathered(bucket.shards, pending)
        for s in self.shards:
            if s.stage == 1:
                s.shard.grad = None   # rebuilt from the parameter's at the next step

    def gather_async(self, shards: list[Sharded]):
        """The all-gather of `shards`' updated values, launched (stage 3's units too)."""
        return all_gather_async(torch.cat([s.values() for s in shards]), self.shard_group,
                                self.stats, "zero", self.successor_remote)

    def write_gathered(self, shards: list[Sharded], pending) -> None:
        """A finished `gather_async` written into the parameters, straight from the gathered
        buffer's columns (whose storage must be there)."""
        every = pending.wait().view(self.shard_size, sum(s.chunk for s in shards))
        with torch.no_grad():
            for s, rows in zip(shards, torch.split(every, [s.chunk for s in shards], dim=-1)):
                s.write_whole(s.param.data, rows)

    def discard(self) -> None:
        """Every gradient dropped: the shards', and stage 1's parameters' (which the
        optimizer's zero_grad no longer reaches: its groups hold the shards)."""
        for s in self.shards:
            s.shard.grad = None
            if s.stage == 1 or isinstance(s.param.grad, ShardedGradient):
                s.param.grad = None

    def drop_stand_ins(self, *_) -> None:
        """Before a forward: the next backward accumulates into `.grad`, which a stand-in
        would refuse (the chunks stay on the shards)."""
        for s in self.shards:
            if isinstance(s.param.grad, ShardedGradient):
                s.param.grad = None

    def gradients(self) -> list[torch.Tensor]:
        """The gradient chunks this rank owns (stages 2 and 3), for clipping."""
        return [s.shard.grad for s in self.shards if s.stage >= 2 and s.shard.grad is not None]

    def before_load(self) -> None:
        """Stage 3: every value gathered, so a load finds storage to write into (and a
        non-strict load keeps the values it does not name)."""
        with self.guard("model.load_state_dict(), which gathers ZeRO-3's values"):
            self.units.gather_all()

    @contextlib.contextmanager
    def full_values(self):
        """Every stage-3 value gathered inside, freed after (tilework.full_parameters)."""
        with self.guard("tilework.full_parameters(), which gathers ZeRO-3's values"):
            self.units.gather_all()
        self.units.pinned = True
        try:
            yield
        finally:
            self.units.pinned = False
            self.units.free_all()

    def _gather_for_save(self, module, *_) -> None:
        """A model with state-dict hooks of its own gets every value whole before any module
        saves, so the hooks read values (storage to view, under "meta"); one without gets
        each unit gathered in turn afterwards, so no more than one is whole beside the
        copies."""
        from ..tensor.own_hooks import has_own_hooks

        self.was_gathered = [unit.gathered for unit in self.units.units]
        if not has_own_hooks(module):
            return
        if self.gather_to == "meta":
            for unit, was in zip(self.units.units, self.was_gathered):
                if not was:
                    unit.materialize()
            return
        with self.guard("model.state_dict(), which gathers ZeRO-3's values"):
            self.units.gather_all()

    def _full_values(self, module, state: dict, prefix: str, metadata) -> None:
        """model.state_dict(): every entry that is (a view of) a stage-3 value becomes a copy
        of it, taken while its unit is gathered (a meta tensor of its shape under
        `gather_to="meta"`). Entries are found by storage, not by name: a tied weight has two
        names (nanoGPT's lm_head.weight is transformer.wte.weight), and a model's hook may
        rename or cut an entry; each keeps its view's geometry, and tied entries share one
        copy as they share one tensor in torch's own state dict."""
        meta = self.gather_to == "meta"
        copies: dict = {}
        with self.guard("model.state_dict(), which gathers ZeRO-3's values"):
            for unit, was in zip(self.units.units, self.was_gathered):
                storages = {s.param.untyped_storage()._cdata for s in unit.shards}
                entries = [k for k, v in state.items()
                           if torch.is_tensor(v) and v.untyped_storage()._cdata in storages]
                if entries and not meta and not unit.gathered:
                    unit.gather()
                for key in entries:
                    value = state[key]
                    geometry = (value.untyped_storage()._cdata, value.storage_offset(),
                                tuple(value.shape), value.stride(), value.dtype)
                    if geometry not in copies:
                        copies[geometry] = (
                            torch.empty(value.shape, dtype=value.dtype, device="meta")
                            if meta else value.detach().clone())
                    state[key] = copies[geometry]
                if not was:
                    unit.free()

    def after_load(self, names=None) -> None:
        """The model's values were loaded into the parameters (`names`: only these, as a
        local-SGD landing of one fragment or group writes them): the shards follow."""
        shards = self.shards if names is None else \
            [self.by_name[n] for n in names if n in self.by_name]
        with torch.no_grad():
            for s in shards:
                s.shard.copy_(s.take(s.param.detach()))
        if self.units is not None:
            self.units.free_all()

    # -- checkpoints: optimizer state between the shard's layout and the parameter's ------------
    def shard_state(self, name: str, state: dict) -> dict:
        s = self.by_name[name]
        # "step" is a scalar tensor, as is every state of a scalar parameter: told apart by name.
        return {k: s.take(v) if torch.is_tensor(v) and k != "step" and v.shape == s.shape else v
                for k, v in state.items()}

    def full_state(self, name: str, state: dict) -> dict:
        """A shard's optimizer state in the parameter's shape (a collective per tensor)."""
        s = self.by_name[name]
        out = {}
        for k, v in state.items():
            if torch.is_tensor(v) and k != "step" and v.shape == (s.own,):
                mine = padded(v.detach().to(s.param.device).reshape(-1), s.chunk).contiguous()
                every = all_gather_async(mine, self.shard_group, self.stats, "checkpoint").wait()
                out[k] = s.whole(every.view(s.n, s.chunk)).clone()
            else:
                out[k] = v
        return out
