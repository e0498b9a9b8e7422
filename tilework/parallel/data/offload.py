"""Offload (ZeRO-Offload and ZeRO-Infinity, papers 17 and 20): where a ZeRO shard and its
optimizer state live when they need not stay beside the computation.

- On a GPU, "optimizer" puts the shards (the master values the optimizer updates) and so the
  optimizer's state in pinned host memory: the step runs on the CPU, as ZeRO-Offload's does;
  gradients come down after their reduce-scatter and updated shards go up before their
  all-gather (parallel/data/zero.py copies at those points). "all" is the same on a GPU: a stage-3
  shard already is the master value.
- On a CPU host there is no faster memory to spare, so the tier below is disk: the optimizer's
  state ("optimizer"), and the shards too ("all"), live in memory-mapped files under
  `offload_dir` (ZeRO-Infinity's NVMe tier). Their pages are file-backed, so the kernel can
  write them out and drop them under memory pressure instead of failing: a memory-capped
  process (a cgroup limit) then trains a model whose state would not fit its anonymous memory.
  The files are unlinked as soon as they are mapped: nothing is left behind, even by a crash.

Optimizer state is created by the optimizer at its first step, in ordinary memory; it moves to
its tier right after that step (Adam and AdamW's state is created ahead, on the tier, so even
the first step does not hold it twice).
"""

from __future__ import annotations

import os
import tempfile

import torch


class Offload:
    def __init__(self, kind: str, directory: str | None, rank: int, compute: torch.device):
        self.kind, self.compute = kind, compute
        self.on_gpu = compute.type == "cuda"
        self.directory = None
        if kind != "none" and not self.on_gpu:
            self.directory = directory or tempfile.gettempdir()
            os.makedirs(self.directory, exist_ok=True)
        self.prefix = f"tilework-offload-{os.getpid()}-rank{rank}-"
        self.placed: set[int] = set()   # ids of state tensors already on their tier

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def shard(self, values: torch.Tensor) -> torch.Tensor:
        """Where a shard's values live."""
        if self.kind == "none":
            return values
        if self.on_gpu:
            return values.detach().to("cpu").pin_memory()
        return self._file_backed(values) if self.kind == "all" else values

    def state(self, values: torch.Tensor) -> torch.Tensor:
        """Where an optimizer state tensor lives."""
        if self.kind == "none" or values.dim() == 0:   # scalars (Adam's step) stay put
            return values
        if self.on_gpu:
            return values if values.device.type == "cpu" else values.to("cpu")
        return self._file_backed(values)

    def _file_backed(self, values: torch.Tensor) -> torch.Tensor:
        # A file of our own in the directory (no directory of ours to clean up), mapped, then
        # unlinked: the mapping stays, the name goes, so nothing is left behind even by a kill.
        handle, path = tempfile.mkstemp(prefix=self.prefix, suffix=".bin", dir=self.directory)
        os.close(handle)
        mapped = torch.from_file(path, shared=True, size=values.numel(), dtype=values.dtype)
        os.unlink(path)
        mapped = mapped.view(values.shape)
        mapped.copy_(values)
        self.placed.add(id(mapped))
        return mapped

    # -- the optimizer's state -------------------------------------------------------------------
    def prepare(self, optimizer, shards) -> None:
        """Adam-family state made ahead, on its tier (torch's step then finds and uses it)."""
        if self.kind == "none" or self.on_gpu:
            return
        for s in shards:
            p = s.shard
            if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or \
                    optimizer.state.get(p):
                continue
            group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
            state = {"step": torch.tensor(0.0, dtype=torch.float32, device="cpu"),
                     "exp_avg": self.state(torch.zeros_like(p)),
                     "exp_avg_sq": self.state(torch.zeros_like(p))}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = self.state(torch.zeros_like(p))
            optimizer.state[p] = state

    def settle(self, optimizer, shards) -> None:
        """After a step: state the optimizer made in ordinary memory moved to its tier."""
        if self.kind == "none":
            return
        for s in shards:
            state = optimizer.state.get(s.shard)
            for key, value in (state or {}).items():
                if torch.is_tensor(value) and value.dim() and id(value) not in self.placed:
                    state[key] = self.state(value)   # a mapped file records itself placed
