"""What the public API holds on a parallelized model: one object per kind of run with the same
methods, so `api.py` asks the run and never which kind it is.

`DataParallelRuntime` is a data-parallel plan's: the engine over the world. `MeshRuntime` a
mesh plan's: the engine over this rank's dp group, and the mesh (`runtime/apply.MeshParallel`:
its groups, the layout applied, the pipeline) whose axes add to some answers (the world, the
replica's coordinate, the axes' bytes for the stats). Clipping is one path for both
(runtime/clip.py). Checkpoints are one path for both: the engine's
state_dict and load_state_dict, and `checkpoint.unparallelize`, take the mesh's steps (tp and
pp gathers) where the engine has one.
"""

from __future__ import annotations

import torch

from ..checkpoint.unparallelize import unparallelize
from ..comm.groups import Groups


class DataParallelRuntime:
    # Where `tilework.state_dict` gathers what is spread over ranks: data parallel alone, the
    # tables and ZeRO state to rank 0 (every rank keeps the rest).
    state_dict_dst: int | None = 0

    def __init__(self, engine):
        self.engine = engine

    @property
    def world(self) -> Groups:
        return self.engine.groups

    def data_parallel_rank(self) -> tuple[int, int]:
        return self.engine.groups.rank, self.engine.groups.world_size

    def batch_shares(self) -> tuple[int, ...] | None:
        """Each data-parallel rank's (on a mesh: replica's) samples of the global batch."""
        return self.engine.plan.batch_shares

    def stats(self) -> dict:
        return self.engine.stats_dict()

    def state_dict(self) -> dict:
        """`tilework.state_dict`: single-device layout (checkpoint/gather.py)."""
        return self.engine.state_dict(dst=self.state_dict_dst)

    def state_to_write(self) -> dict | None:
        """What rank 0 writes to a checkpoint (None where a rank holds nothing to write)."""
        return self.engine.state_dict(dst=0)

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                        foreach) -> torch.Tensor:
        return self.engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def unparallelize(self):
        return unparallelize(self.engine, self.engine.optimizer)


class MeshRuntime(DataParallelRuntime):
    # Assembled on every rank: gathered to rank 0, a mesh's state is None on the others.
    state_dict_dst = None

    def __init__(self, engine):
        super().__init__(engine)
        self.mesh = engine.mesh

    @property
    def world(self) -> Groups:
        return self.mesh.world    # the engine's groups are one dp group's

    def data_parallel_rank(self) -> tuple[int, int]:
        return self.mesh.groups.coord("dp"), self.mesh.mesh.size_of("dp")

    def batch_shares(self) -> tuple[int, ...] | None:
        return self.mesh.plan.batch_shares   # the engine's part repeats them over cp

    def stats(self) -> dict:
        out = self.engine.stats_dict()
        extra = self.mesh.stats.as_dict()
        for key in ("total", "last_step"):
            out[key] = {**out[key], **extra[key]}
        return out


def runtime_of(model) -> DataParallelRuntime | None:
    """The run `model` is part of (None: not parallelized by tilework)."""
    engine = getattr(model, "_tilework_engine", None)
    if engine is None:
        return None
    return DataParallelRuntime(engine) if engine.mesh is None else MeshRuntime(engine)
