"""What the public API holds on a parallelized model: one object per kind of run with the same
methods, so `api.py` asks the run and never which kind it is.

`DataParallelRuntime` is a data-parallel plan's: the engine over the world. `MeshRuntime` a
mesh plan's: the engine over this rank's dp group, and the mesh (`runtime/apply.MeshParallel`:
its groups, the layout applied, the pipeline) whose axes add to each answer (tp and pp gathers
for the state, the parts' norms for clipping, the axes' bytes for the stats).
"""

from __future__ import annotations

import torch

from ..checkpoint import mesh_state
from ..comm.groups import Groups
from .mesh_clip import clip_norm_on_mesh


class DataParallelRuntime:
    def __init__(self, engine):
        self.engine = engine

    @property
    def world(self) -> Groups:
        return self.engine.groups

    def data_parallel_rank(self) -> tuple[int, int]:
        return self.engine.groups.rank, self.engine.groups.world_size

    def stats(self) -> dict:
        return self.engine.stats_dict()

    def state_dict(self) -> dict:
        """`tilework.state_dict`: single-device layout, server tables complete on rank 0."""
        return self.engine.state_dict()

    def state_to_write(self) -> dict | None:
        """What rank 0 writes to a checkpoint (None where a rank holds nothing to write)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                        foreach) -> torch.Tensor:
        return self.engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def unparallelize(self, model):
        self.engine.undo()
        return model, self.engine.optimizer


class MeshRuntime(DataParallelRuntime):
    def __init__(self, engine):
        super().__init__(engine)
        self.mesh = engine.mesh

    @property
    def world(self) -> Groups:
        return self.mesh.world    # the engine's groups are one dp group's

    def data_parallel_rank(self) -> tuple[int, int]:
        return self.mesh.groups.coord("dp"), self.mesh.mesh.size_of("dp")

    def stats(self) -> dict:
        out = self.engine.stats_dict()
        extra = self.mesh.stats.as_dict()
        for key in ("total", "last_step"):
            out[key] = {**out[key], **extra[key]}
        return out

    def state_dict(self) -> dict:
        return mesh_state.full_state(self.engine)   # assembled on every rank

    def state_to_write(self) -> dict | None:
        return mesh_state.full_state(self.engine, dst=0)   # on rank 0 alone

    def load_state_dict(self, state: dict) -> None:
        mesh_state.load_full_state(self.engine, state)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                        foreach) -> torch.Tensor:
        with self.engine.guard.call("tilework.clip_grad_norm_()"):
            return clip_norm_on_mesh(self.engine, max_norm, norm_type, error_if_nonfinite,
                                     foreach)

    def unparallelize(self, model):
        return mesh_state.unparallelize_mesh(self.engine, self.engine.optimizer)


def runtime_of(model) -> DataParallelRuntime | None:
    """The run `model` is part of (None: not parallelized by tilework)."""
    engine = getattr(model, "_tilework_engine", None)
    if engine is None:
        return None
    return DataParallelRuntime(engine) if engine.mesh is None else MeshRuntime(engine)
