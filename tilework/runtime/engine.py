"""Apply a Plan to a model and its optimizer: the runtime half of "one plan, two executors".

After `Engine(...)` the user's model and optimizer work as under DistributedDataParallel:
- all-reduce parameters stay ordinary parameters; `DenseSync` buckets their gradients, and when
  `backward()` returns (an end-of-backward autograd callback) every `.grad` holds the average;
- parameter-server tables leave the model: their module is replaced by a `ShardedEmbedding`
  that pulls rows; at the end of backward their gradient rows go to their owners, and
  `optimizer.step()` has the owners apply them row-wise (the optimizer forgets the tables);
- dense parameters on the servers (mode="ps") stay as replicas: their gradient goes to its
  owners at the end of backward (`.grad` is then None), the step updates the owners' rows and
  pulls them back.
- dense parameters at a ZeRO stage (parallel/data/zero.py) have their shards stand in for them in
  the optimizer; stage 2 and 3 gradients are reduce-scattered onto the shards, 3's values gathered.
- under local SGD (sync="diloco", parallel/data/outer.py) the dense gradients stay local and
  every H-th `optimizer.step()` ends with the outer step on the averaged pseudo-gradient.
`no_sync()` and DDP's `require_backward_grad_sync` keep a backward local. No training-loop
change is needed; clipping that must include the tables is `tilework.clip_grad_norm_`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd import Variable

from ..checkpoint.gather import gathered_state, plain_optimizer_state
from ..checkpoint.state import load_state, parallel_optimizer_state
from ..comm.counted import Stats, broadcast
from ..comm.guard import CallGuard
from ..comm.wire import ring_allreduce_bytes
from ..errors import InputError, PlanError, use_allreduce_hint
from ..optim.rowwise import row_optimizer
from ..parallel.data.checks import InputChecks
from ..parallel.data.dense import DenseSync
from ..parallel.data.offload import Offload
from ..parallel.data.outer import LocalSGD, workers_of
from ..parallel.data.zero import ZeroSync
from ..parallel.rows.exchange import pull_tables
from ..parallel.rows.gather import GatheredTable, sync_tables
from ..parallel.rows.lookups import Batch
from ..parallel.rows.push import EarlyPush, push_route
from ..parallel.rows.sparse import DenseServed, PSTable, ShardedEmbedding
from ..plans.analysis import embedding_modules
from ..plans.plan import Plan
from .changes import Changes, leave_optimizer, replace_module
from .clip import clip_norm, clip_value_with_servers
from .hooks import PicklesAsNoop, plain_no_sync, post_accumulate_grad_hook
from .preflight import (
    check_device,
    check_not_tied,
    check_optimizer_covers,
    refuse_wrapped,
)


def _no_engine():
    return None


class Engine:
    """A plan applied to a model and its optimizer. `__init__` lists the changes in the order
    they are made; each step is one method below with one concern."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, groups,
                 plan: Plan, check_inputs: bool = True, weigh_output: bool = True):
        self.model, self.optimizer, self.groups, self.plan = model, optimizer, groups, plan
        self.stats = Stats()
        self.step_ended: list = []  # called where a step without an optimizer ends (a mesh's)
        self.lookups = Batch(self._pull)   # server-table lookups waiting for their rows
        self.changes = Changes()   # every change to the user's objects, with its undo
        # On a dp x pp x cp x tp mesh, runtime/apply.MeshParallel (set by runtime/apply.apply_dp):
        # the mesh, its groups and what was applied before this engine over one dp group.
        self.mesh = None
        self.guard = CallGuard(groups.store, groups.rank, groups.world_size, groups.env.error_file)
        self._refuse_what_cannot_work()
        self._start_from_rank_0()
        dense = self._serve_parameters()
        self._bucket_dense(dense, check_inputs)
        self._hook_model()
        # Uneven shares: the output's gradient weighted by this rank's (a pipeline's part runs
        # no forward of its own: its last stage seeds the weight instead, apply.apply_dp).
        if plan.batch_shares is not None and weigh_output:
            from .shares import install

            install(model, plan.batch_shares, groups.rank, self.checks, self.changes)
        if optimizer is not None:
            self._hook_optimizer()
        self.changes.set_attribute(model, "_tilework_engine", self, "model._tilework_engine")

    # -- the changes, in order -------------------------------------------------------------------
    def _refuse_what_cannot_work(self) -> None:
        """Wrapped modules, devices the backend cannot carry, optimizers that miss parameters
        (models and plans that differ across ranks: apply, over the world, first)."""
        model, optimizer, plan = self.model, self.optimizer, self.plan
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise PlanError(f"optimizer: expected a torch.optim.Optimizer or None, got "
                            f"{type(optimizer).__name__}")
        refuse_wrapped(model)
        check_device(model, self.groups)
        if optimizer is not None:
            check_optimizer_covers(model, optimizer)
        elif any(pp.method == "ps" for pp in plan.params):
            raise PlanError("the parameter server applies the optimizer's update: pass the "
                            "optimizer (parallelize(model, opt)), or use mode='allreduce'")
        if plan.outer is not None and optimizer is None:
            raise PlanError("sync='diloco' takes its outer step after optimizer.step(): pass "
                            "the optimizer (parallelize(model, opt))")
        zeros = [pp for pp in plan.params if pp.zero]
        if plan.grad_compress != "none" and (zeros or plan.outer is not None
                                             or plan.parallel is not None):
            raise PlanError(f"grad_compress={plan.grad_compress!r} is built for plain data-"
                            "parallel all-reduce: not with ZeRO, local SGD or tp/pp/cp")
        if plan.outer is not None and zeros and (plan.outer.worker != "host" or any(
                pp.zero == 3 or pp.zero_scope != "host" for pp in zeros)):
            raise PlanError("sync='diloco' with ZeRO shards inside each host: zero 1 or 2, "
                            "zero_scope='host', outer_worker='host'")

    def _start_from_rank_0(self) -> None:
        """Every replica starts from rank 0's parameters and buffers, as under DDP."""
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                broadcast(t.data, 0, self.groups.world, self.stats, "setup")
        self.stats.discard_step()
        self.changes.record("parameters and buffers: rank 0's values (kept on undo)", lambda: None)

    def _serve_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Tables to the servers (their modules replaced), mode="ps" dense parameters served
        as replicas; both leave the optimizer. Returns the all-reduced parameters."""
        model, plan, groups = self.model, self.plan, self.groups
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        named = dict(model.named_parameters())
        self.all_param_bytes = sum(p.numel() * p.element_size() for p in named.values())
        self.embeddings = embedding_modules(model)
        self.tables: dict[str, PSTable] = {}
        self.table_modules, self.served = {}, {}   # name -> ShardedEmbedding, DenseServed
        self.gathered: dict[str, GatheredTable] = {}
        dense: list[tuple[str, nn.Parameter]] = []
        for pp in plan.params:
            p = named[pp.name]
            if pp.method == "allreduce":
                dense.append((pp.name, p))
            elif pp.method == "allgather":
                self.gathered[pp.name] = GatheredTable(pp.name, p,
                                                       mean=plan.sparse_reduce == "mean")
                self.changes.hook(f"{pp.name}: post-accumulate-grad hook (rows all-gathered)",
                                  p.register_post_accumulate_grad_hook(
                                      post_accumulate_grad_hook(self._served_grad)))
            elif pp.name in self.embeddings:
                check_not_tied(model, pp.name, p)
                table = PSTable(pp, p.data, groups, self.stats, plan.local_aggregation,
                                plan.sparse_reduce,
                                row_optimizer(self.optimizer, pp.name, p, lazy=True))
                table.guard = self.guard
                module = ShardedEmbedding(table, self.embeddings[pp.name], self.lookups)
                replace_module(self.changes, model, pp.name, module, self.embeddings[pp.name])
                self.tables[pp.name], self.table_modules[pp.name] = table, module
            else:
                self.served[pp.name] = DenseServed(pp, p, groups, self.stats,
                                                   row_optimizer(self.optimizer, pp.name, p,
                                                                 lazy=False))
                self.changes.hook(f"{pp.name}: post-accumulate-grad hook (served by the servers)",
                                  p.register_post_accumulate_grad_hook(
                                      post_accumulate_grad_hook(self._served_grad)))
        if self.optimizer is not None:
            # Names only: the full tables must not stay alive through this list.
            self.original_groups = [[self.param_names[id(p)] for p in g["params"]]
                                    for g in self.optimizer.param_groups]
            leave_optimizer(self.changes, self.optimizer,
                            {n: named[n] for n in [*self.tables, *self.served]})
        return dense

    def _bucket_dense(self, dense: list[tuple[str, nn.Parameter]], check_inputs: bool) -> None:
        """All-reduce buckets for the dense gradients, and the input checks they carry."""
        groups, topo = self.groups, self.groups.topology
        successor_remote = topo.host_of((groups.rank + 1) % topo.world_size) != groups.host
        # Under local SGD nothing else meets every step: agreeing on the inputs would be a round
        # trip per step, what it exists to avoid (a diverged rank is caught at the outer step).
        check_inputs = check_inputs and self.plan.outer is None
        self.checks = InputChecks(groups, self.stats, successor_remote) if check_inputs else None
        entry, stage = self.plan.by_name(), {p.name: p.zero for p in self.plan.params if p.zero}
        self.zero = ZeroSync([(n, p, stage[n], entry[n].unit, entry[n].zero_chunks)
                              for n, p in dense if n in stage],
                             groups, self.stats, self.plan.bucket_bytes, self.checks, self._touched,
                             Offload(self.plan.offload, self.plan.offload_dir, groups.rank,
                                     groups.device), {entry[n].zero_scope for n in stage},
                             across_hosts=self.plan.outer is None)
        self.zero.guard = self.guard.call
        self.zero.install(self.model, self.optimizer, self.changes, self.param_names)
        replicated = dense   # what local SGD averages: every whole parameter (ZeRO 1, 2 too)
        # Stage 1 keeps DDP's all-reduced gradients; 2 and 3 reduce-scatter their own.
        dense = [(n, p) for n, p in dense if stage.get(n, 0) <= 1]
        self.dense_params = dense
        self.outer = None
        head_dtypes = {t.head.weight.dtype for t in self.tables.values() if t.head is not None}
        self.push_route = push_route(list(self.tables.values()), groups)
        rider_dtype = head_dtypes.pop() if len(head_dtypes) == 1 else None
        push_dtype = self.push_route.dtype
        group, size = groups.world, groups.world_size
        if self.plan.outer is not None:   # averaged every few steps, not every backward
            workers = workers_of(groups, self.plan.outer.worker)
            self.outer = LocalSGD(replicated, workers, self.stats, self.plan.outer,
                                  self.plan.bucket_bytes)
            # ZeRO's shards are what the optimizer steps: they follow each landing.
            self.outer.landed = self.zero.after_load if self.zero.shards else None
            # A host's ranks stay one replica: their gradients are averaged every step over the
            # host's group, where nothing of the world's (heads' sums, the push) can ride.
            group, size = workers.within, workers.size
            rider_dtype = push_dtype = None
            successor_remote = False
            if size == 1:
                dense = []
                self._densify_sparse_gradients()
        half_width = {"bf16": torch.bfloat16, "fp16": torch.float16}
        self.dense = DenseSync(dense, group, size, self.stats,
                               self.plan.bucket_bytes, successor_remote, self.checks, self._touched,
                               rider_dtype=rider_dtype, push_dtype=push_dtype,
                               wire_dtype=half_width.get(self.plan.grad_compress),
                               powersgd=(self.plan.powersgd_rank, self.plan.powersgd_start)
                               if self.plan.grad_compress == "powersgd" else None,
                               topk=self.plan.topk_ratio
                               if self.plan.grad_compress == "topk" else None)
        self.changes.record("dense parameters: post-accumulate-grad hooks (all-reduce buckets)",
                            lambda: [handle.remove() for handle in self.dense.handles])
        self.early = EarlyPush(self.tables, self.push_route, self.checks, self._touched)
        if self.checks is not None:   # server tables check their ids before the pull
            self.checks.install(self.model, {n: m for n, m in self.embeddings.items()
                                             if n not in self.tables}, self.changes)
        # Per backward: whether it synchronises, and whether its end callback is queued.
        self._callback_queued, self._sync_this_backward = False, True
        self._unsynced = False    # server gradients left local by a backward without sync
        self._unapplied = False   # server gradients pushed and waiting for optimizer.step()

    def _hook_model(self) -> None:
        """DDP's no_sync and flag, the zeroed-without-a-step check, served rows after a load."""
        model, changes = self.model, self.changes
        if not hasattr(model, "require_backward_grad_sync"):
            # DDP's flag, for programs written for DDP
            changes.set_attribute(model, "require_backward_grad_sync", True,
                                  "model.require_backward_grad_sync (DDP's flag)")
        changes.set_attribute(model, "no_sync", plain_no_sync(self.no_sync),
                              "model.no_sync (DDP's context manager)")
        changes.hook("model: forward pre-hook (zeroed gradients without a step)",
                     model.register_forward_pre_hook(PicklesAsNoop(self._on_forward)))
        changes.hook("model: load_state_dict post-hook (served rows follow a load)",
                     model.register_load_state_dict_post_hook(PicklesAsNoop(self._after_load)))

    def _hook_optimizer(self) -> None:
        """The step applies the servers' rows; zero_grad drops them; state dicts in the plain
        optimizer's layout."""
        optimizer, changes = self.optimizer, self.changes
        changes.hook("optimizer: step pre-hook (apply the servers' rows)",
                     optimizer.register_step_pre_hook(lambda *_: self._before_step()))
        changes.hook("optimizer: step post-hook (served replicas pulled)",
                     optimizer.register_step_post_hook(lambda *_: self._after_step()))
        changes.extend_zero_grad(optimizer, self.discard_server_gradients,
                                 "optimizer.zero_grad (also drops the servers' rows)")
        changes.hook("optimizer: state_dict post-hook (plain layout)",
                     optimizer.register_state_dict_post_hook(
                         lambda opt, state: plain_optimizer_state(self, state)))
        changes.hook("optimizer: load_state_dict pre-hook (plain layout)",
                     optimizer.register_load_state_dict_pre_hook(
                         lambda opt, state: parallel_optimizer_state(self, state)))

    def __reduce__(self):  # torch.save(model): the saved model is a plain one
        return (_no_engine, ())

    # -- the gradient's way: backward, its end, the step ----------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (gradient accumulation): the next backward outside it
        averages the sum, as DDP's `no_sync`."""
        before, self.model.require_backward_grad_sync = self.model.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.model.require_backward_grad_sync = before

    def _densify_sparse_gradients(self) -> None:
        """Under local SGD with nothing bucketed, a sparse embedding's gradient is made dense
        after backward, as the buckets make it under every-step sync: the user's optimizer
        sees what it sees there (a dense Adam on an all-reduced table works in both)."""
        def densify(p):
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()

        for name, p in self.outer.params:
            if getattr(self.embeddings.get(name), "sparse", False):
                self.changes.hook(f"{name}: post-accumulate-grad hook (sparse gradient made "
                                  "dense, as the buckets make it)",
                                  p.register_post_accumulate_grad_hook(PicklesAsNoop(densify)))

    def _touched(self) -> bool:
        """Called by every gradient hook of ours: queue the end-of-backward work once per
        backward; returns whether this backward synchronises."""
        if not self._callback_queued:
            self._callback_queued = True
            self._sync_this_backward = bool(self.model.require_backward_grad_sync)
            Variable._execution_engine.queue_callback(self._end_of_backward)
        return self._sync_this_backward

    def _served_grad(self, param) -> None:
        self._touched()

    def _end_of_backward(self) -> None:
        with self.guard.call("the gradient sync at the end of backward()"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if not self._sync_this_backward:
            for table in self.tables.values():
                table.coalesce()
            self._unsynced = bool(self.tables or self.served)
            self.zero.end_backward()
            return
        self._check_server_gradients()  # before the dense sync, which carries the verdict
        heads = [t.head for t in self.tables.values() if t.head is not None]
        heads_ride = self.dense.launch_rest(heads, push=bool(self.tables))
        self.zero.launch_rest()
        self._push_servers(heads_ride)  # carrying the last bucket, where it rides
        # While the buckets are on the wire.
        sync_tables(list(self.gathered.values()), self.groups.world, self.groups.world_size,
                    self.stats)
        self.dense.wait()
        self.zero.wait()
        self.zero.end_backward()
        if self.optimizer is None:  # no step to wait for: this is where the step ends
            if self.checks is not None:
                self._check_inputs()
            self.stats.end_step()
            for ended in self.step_ended:
                ended()

    def _sync_servers(self) -> None:
        """Server gradients to their owners (collective); checked for NaN/inf before they go."""
        self._check_server_gradients()
        self._push_servers()

    def _check_server_gradients(self) -> None:
        if self.checks is not None:
            self.checks.on_tables(self.tables.values())
            for name, served in [*self.served.items(), *self.gathered.items()]:
                self.checks.on_gradients([(name, served.param.grad)])

    def _pull(self, lookups) -> None:
        """The rows of waiting lookups, every table in one exchange per hop; each lookup's
        output computed as its module would have, under the grad mode of its call."""
        names = ", ".join(dict.fromkeys(lookup.table.name for lookup in lookups))
        with self.guard.call(f"a lookup in {names} (the model's forward)"):
            rows = pull_tables([lookup.table for lookup in lookups],
                               [lookup.ids for lookup in lookups],
                               [lookup.grad_enabled for lookup in lookups],
                               [lookup.key for lookup in lookups], self.lookups.ahead)
        for lookup, r in zip(lookups, rows):
            lookup.complete(r)

    def _push_servers(self, heads_ride: bool = False) -> None:
        """`heads_ride`: the hot heads' sums are on their way in the last dense bucket."""
        self.early.finish(not heads_ride, self.push_route.start(self.dense))
        for served in self.served.values():
            served.push()
        self._unsynced, self._unapplied = False, bool(self.tables or self.served)

    def discard_server_gradients(self) -> None:
        for part in [*self.tables.values(), *self.served.values()]:
            part.discard()
        self.zero.discard()
        self._unsynced = self._unapplied = False

    def _on_forward(self, module, args) -> None:
        # A loop that zeroes gradients itself (model.zero_grad(), a hand-written update) and
        # never calls optimizer.step() would leave the server tables untouched, silently.
        if self._unapplied and torch.is_grad_enabled() and self.dense_params and all(
                p.grad is None for _, p in self.dense_params if p.requires_grad):
            served = [*self.tables, *self.served]
            names, first = ", ".join(served), served[0]
            raise PlanError(f"gradients were zeroed without optimizer.step(), which is what "
                            f"updates the parameters on the servers ({names}): call "
                            f"optimizer.step(), or keep them all-reduced: "
                            f"{use_allreduce_hint(first)}, or parallelize(model, None) for a "
                            "hand-written update")

    def _before_step(self) -> None:
        with self.guard.call("optimizer.step()"):
            self._prepare_step()

    def _prepare_step(self) -> None:
        self.lookups.flush()   # a lookup made before the step reads the rows before it
        if self._unsynced:
            self._sync_servers()
        if self.checks is not None:
            self._check_inputs()
        for part in [*self.tables.values(), *self.served.values()]:
            part.apply()
        self._unapplied = False
        self.zero.before_step()

    def _check_inputs(self) -> None:
        """Every rank agrees the step's inputs were sound before anything is applied."""
        checks = self.checks
        if self.groups.world_size == 1:  # no buckets are launched: nothing saw the gradients
            checks.on_gradients([(n, p.grad) for n, p in self.dense_params])
        try:
            checks.agree()
        except InputError:
            # Every rank is here: drop the step together, so a caller that catches this can go
            # on with the next batch.
            self.discard_server_gradients()
            for p in self.model.parameters():
                p.grad = None
            self.stats.end_step()
            raise

    def _after_step(self) -> None:
        with self.guard.call("optimizer.step()"):
            self.zero.after_step()
            for served in self.served.values():
                served.pull()
            if self.outer is not None:
                self.outer.after_step()
        self.stats.end_step()

    def _after_load(self, module, incompatible) -> None:
        # load_state_dict wrote the replicas of server-updated parameters: the owners' rows follow
        for served in self.served.values():
            served.shard.copy_(served.take_shard(served.param.detach()))
        self.zero.after_load()

    # -- clipping, with the gradients the servers hold ------------------------------------------
    def server_gradients(self) -> list[torch.Tensor]:
        """The server rows' gradients this rank holds as their owner (pushed first if a
        backward without sync left them local)."""
        if self._unsynced:
            self._sync_servers()
        parts = [part.received_grads() for part in [*self.tables.values(), *self.served.values()]]
        return [g for g in parts if g is not None] + self.zero.gradients()

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                        foreach) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the model's parameters and the gradients the
        servers, ZeRO's chunks and the mesh's other ranks hold (runtime/clip.py)."""
        with self.guard.call("tilework.clip_grad_norm_()"):
            return clip_norm(self, max_norm, norm_type, error_if_nonfinite, foreach)

    def clip_grad_value_(self, clip_value: float, foreach) -> None:
        with self.guard.call("tilework.clip_grad_value_()"):
            clip_value_with_servers(self, clip_value)

    # -- reporting -----------------------------------------------------------------------------
    def stats_dict(self) -> dict:
        out = self.stats.as_dict()
        out["dense_allreduce_bytes_per_step"] = ring_allreduce_bytes(self.all_param_bytes,
                                                                     self.groups.world_size)
        out["shard_bytes"] = {n: t.shard_bytes() for n, t in self.tables.items()}
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, dst: int = 0) -> dict:
        """Single-device layout: tables gathered to rank `dst` (None on other ranks).

        Optimizer state is keyed by parameter name, so it loads at any world size and plan.
        """
        with self.guard.call("tilework.state_dict() / tilework.save()"):
            return gathered_state(self, dst)

    def load_state_dict(self, state: dict) -> None:
        self.lookups.flush()
        load_state(self, state)
