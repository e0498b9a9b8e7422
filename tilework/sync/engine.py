"""Apply a Plan to a model and its optimizer: the runtime half of "one plan, two executors".

After `Engine(...)` the user's model and optimizer work as before:
- all-reduce parameters stay ordinary parameters; `DenseSync` buckets their gradients;
- parameter-server tables leave the model: their module is replaced by a `ShardedEmbedding`
  that pulls rows, and the optimizer forgets them; owners update them row-wise;
- dense parameters on the servers (mode="ps") stay as replicas, updated by their owners.
The optimizer's step pre-hook finishes the all-reduces and pushes the sparse gradients; its
post-hook pulls the server-updated dense replicas. No training-loop change is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..analysis import embedding_modules
from ..comm.counted import Stats, broadcast, ring_allreduce_bytes
from ..errors import CheckpointError, InputError, PlanError
from ..optim.rowwise import RowOptimizer, family_of
from ..plan import Plan
from .checks import InputChecks, check_ids
from .dense import DenseSync
from .sparse import DenseServed, PSTable, ShardedEmbedding


def check_same_model_everywhere(model: nn.Module, groups) -> None:
    """Parameter names, shapes and dtypes must agree on every rank, else collectives deadlock."""
    if groups.world_size == 1:
        return
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    everyone: list = [None] * groups.world_size
    dist.all_gather_object(everyone, mine, group=groups.world)
    reference = dict((n, (s, d)) for n, s, d in everyone[0])
    for rank, theirs in enumerate(everyone[1:], start=1):
        theirs_map = dict((n, (s, d)) for n, s, d in theirs)
        for name in sorted(set(reference) | set(theirs_map)):
            a, b = reference.get(name), theirs_map.get(name)
            if a != b:
                def show(x):
                    return "absent" if x is None else f"shape {x[0]} {x[1]}"
                raise PlanError(f"the model differs across ranks: parameter {name} is "
                                f"{show(a)} on rank 0 but {show(b)} on rank {rank}")


def state_mismatch(expected: dict[str, tuple], given) -> str | None:
    """What differs between the shapes a model expects and a saved model state, or None."""
    if not isinstance(given, dict):
        return "no model state"
    for key in sorted(set(expected) | set(given)):
        if key not in given:
            return f"{key} is missing"
        if key not in expected:
            return f"{key} is unexpected"
        value = given[key]
        if not torch.is_tensor(value) or tuple(value.shape) != expected[key]:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            return f"{key} has shape {shape} in the checkpoint, {expected[key]} in the model"
    return None


class Engine:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, groups, plan: Plan,
                 check_inputs: bool = True):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PlanError(f"optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        self.model, self.optimizer, self.groups, self.plan = model, optimizer, groups, plan
        self.stats = Stats()
        check_same_model_everywhere(model, groups)
        self._check_optimizer_covers(model, optimizer)
        with torch.no_grad():  # every replica starts from rank 0's values, as DDP does
            for t in [*model.parameters(), *model.buffers()]:
                broadcast(t.data, 0, groups.world, self.stats, "setup")
        self.stats.discard_step()
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        named = dict(model.named_parameters())
        modules = embedding_modules(model)
        self.tables: dict[str, PSTable] = {}
        self.served: dict[str, DenseServed] = {}
        dense: list[tuple[str, nn.Parameter]] = []
        for pp in plan.params:
            p = named[pp.name]
            if pp.method == "allreduce":
                dense.append((pp.name, p))
            elif pp.name in modules:
                self._check_not_tied(model, pp.name, p)
                table = PSTable(pp, p.data, groups, self.stats, plan.local_aggregation,
                                plan.sparse_reduce, self._row_optimizer(pp.name, p, lazy=True))
                self._replace_module(pp.name, ShardedEmbedding(table, modules[pp.name]))
                self.tables[pp.name] = table
            else:
                self.served[pp.name] = DenseServed(pp, p, groups, self.stats,
                                                   self._row_optimizer(pp.name, p, lazy=False))
        self._forget(set(self.tables) | set(self.served))
        topo = groups.topology
        successor_remote = topo.host_of((groups.rank + 1) % topo.world_size) != groups.host
        self.checks = InputChecks(groups, self.stats, successor_remote) if check_inputs else None
        self.dense_params = dense
        self.dense = DenseSync(dense, groups.world, groups.world_size, self.stats,
                               plan.bucket_bytes, successor_remote, self.checks)
        if self.checks is not None:
            self._install_checks(modules)
        self.all_param_bytes = sum(p.numel() * p.element_size() for p in named.values())
        optimizer.register_step_pre_hook(lambda *_: self._before_step())
        optimizer.register_step_post_hook(lambda *_: self._after_step())
        user_zero_grad = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True):
            for t in self.tables.values():
                t.pending = []
            user_zero_grad(set_to_none=set_to_none)

        optimizer.zero_grad = zero_grad
        model._tilework_engine = self
        model.no_sync = self.dense.no_sync

    # -- set-up helpers ------------------------------------------------------------------------
    @staticmethod
    def _check_optimizer_covers(model, optimizer):
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in in_opt:
                raise PlanError(f"{name} is trainable but not in the optimizer: pass an optimizer "
                                "built over model.parameters()")

    @staticmethod
    def _check_not_tied(model, name, p):
        owners = [m for m in model.modules() if any(q is p for q in m.parameters(recurse=False))]
        if len(owners) > 1:
            raise PlanError(f"{name} is shared by {len(owners)} modules (tied weights); a tied "
                            "table cannot move to the parameter server yet: use allreduce for it")

    def _group_of(self, p):
        return next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))

    def _row_optimizer(self, name, p, lazy):
        group = self._group_of(p)
        family = family_of(self.optimizer, group, name)
        return lambda shard: RowOptimizer(family, group, shard, lazy=lazy)

    def _replace_module(self, param_name: str, replacement: nn.Module) -> None:
        path = param_name.rsplit(".", 1)[0]
        parent_path, _, child = path.rpartition(".")
        parent = self.model.get_submodule(parent_path) if parent_path else self.model
        setattr(parent, child, replacement)

    def _forget(self, names: set[str]) -> None:
        """The optimizer no longer owns what the servers update (and frees the full tables)."""
        gone = {pid for pid, n in self.param_names.items() if n in names}
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in gone]
        for p in list(self.optimizer.state):
            if id(p) in gone:
                del self.optimizer.state[p]

    def _install_checks(self, embeddings: dict[str, nn.Module]) -> None:
        checks, rank = self.checks, self.groups.rank
        self.model.register_forward_pre_hook(lambda m, args, kwargs: checks.on_forward(args, kwargs),
                                             with_kwargs=True)
        self.model.register_forward_hook(lambda m, args, out: checks.on_output(out))
        for name, module in embeddings.items():
            if name not in self.tables:  # server tables check their ids before the pull
                module.register_forward_pre_hook(
                    lambda m, args, name=name: check_ids(name, args[0], m.num_embeddings, rank))

    # -- per step ------------------------------------------------------------------------------
    def _before_step(self) -> None:
        if self.checks is not None:
            self._check_inputs()
        self.dense.finish()
        for table in self.tables.values():
            table.push_and_apply()
        for served in self.served.values():
            served.push_and_apply()

    def _check_inputs(self) -> None:
        """Every rank agrees the step's inputs were sound before anything is sent or applied."""
        checks = self.checks
        if self.groups.world_size == 1:  # no buckets are launched: nothing saw the gradients
            checks.on_gradients([(n, p.grad) for n, p in self.dense_params])
        for name, table in self.tables.items():
            checks.on_gradients([(name, g) for _, g in table.pending])
        for name, served in self.served.items():
            checks.on_gradients([(name, served.param.grad)])
        try:
            checks.agree()
        except InputError:
            # Every rank is here: drain the in-flight all-reduces together and drop the step,
            # so a caller that catches this can go on with the next batch.
            self.dense.finish()
            for table in self.tables.values():
                table.pending = []
            for p in self.model.parameters():
                p.grad = None
            self.stats.end_step()
            raise

    def _after_step(self) -> None:
        for served in self.served.values():
            served.pull()
        self.stats.end_step()

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
        model_state = dict(self.model.state_dict())
        rows: dict[str, dict] = {}
        for name, part in [*self.tables.items(), *self.served.items()]:
            if name in self.tables:
                model_state[name] = part.gather(part.shard, dst)
            state = {k: part.gather(v, dst) for k, v in part.optimizer.state_tensors().items()}
            rows[name] = {"step": part.optimizer.step_count, **state}
        dense_state = {self.param_names[id(p)]: {k: v for k, v in s.items()}
                       for p, s in self.optimizer.state.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"model": model_state,
                "optimizer": {"dense": dense_state, "groups": groups, "rows": rows}}

    def _check_state(self, state: dict) -> None:
        """Everything a load would touch, checked before anything is: a mismatch never
        half-loads."""
        expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        expected.update({name: table.plan.shape for name, table in self.tables.items()})
        opt = state.get("optimizer") if isinstance(state, dict) else None
        if not isinstance(opt, dict) or not {"dense", "groups", "rows"} <= set(opt):
            raise CheckpointError("checkpoint does not match the model: no optimizer state in "
                                  "tilework's layout")
        problem = state_mismatch(expected, state.get("model"))
        params = dict(self.model.named_parameters())
        for name, saved in opt["dense"].items():
            if problem:
                break
            if name not in params:
                problem = f"optimizer state for {name}, which the model does not train here"
            for key, value in saved.items():
                if torch.is_tensor(value) and value.dim() and value.shape != params[name].shape:
                    problem = (f"optimizer {key} of {name} has shape {tuple(value.shape)}, "
                               f"the parameter {tuple(params[name].shape)}")
        for name, part in [*self.tables.items(), *self.served.items()]:
            if problem:
                break
            saved = opt["rows"].get(name)
            if saved is None or "step" not in saved:
                problem = f"no row-wise optimizer state for {name}"
                continue
            for key, value in saved.items():
                if key != "step" and tuple(value.shape)[:1] != (part.layout.rows,):
                    problem = (f"optimizer {key} of {name} has {tuple(value.shape)[:1]} rows, "
                               f"the table {part.layout.rows}")
        if not problem and len(opt["groups"]) != len(self.optimizer.param_groups):
            problem = (f"{len(opt['groups'])} optimizer parameter groups in the checkpoint, "
                       f"{len(self.optimizer.param_groups)} here")
        if problem:
            raise CheckpointError(f"checkpoint does not match the model: {problem}")

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state)
        model_state = dict(state["model"])
        for name, table in self.tables.items():
            table.shard.copy_(table.take_shard(model_state.pop(name)))
        self.model.load_state_dict(model_state)
        for served in self.served.values():
            served.shard.copy_(served.take_shard(served.param.detach()))
        opt_state = state["optimizer"]
        by_name = {n: p for n, p in self.model.named_parameters()}
        for name, s in opt_state["dense"].items():
            self.optimizer.state[by_name[name]] = {k: (v.clone() if torch.is_tensor(v) else v)
                                                   for k, v in s.items()}
        for group, saved in zip(self.optimizer.param_groups, opt_state["groups"]):
            group.update(saved)
        for name, part in [*self.tables.items(), *self.served.items()]:
            saved = dict(opt_state["rows"][name])
            step = saved.pop("step")
            part.optimizer.load(step, {k: part.take_shard(v) for k, v in saved.items()})
