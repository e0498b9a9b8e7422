"""tilework: train a single-device PyTorch program across processes and machines.

    model, opt = tilework.parallelize(model, opt)   # inside a `tilework run` / torchrun process
    plan = tilework.plan(model, tilework.ParallelConfig(), cluster)   # pure: what it would do
"""

import torch as _torch

# The oldest torch the suite was run on (docs/torch-versions.md); pyproject's floor says the same.
MIN_TORCH = (2, 6)
if tuple(int(x) for x in _torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
    _floor = ".".join(map(str, MIN_TORCH))
    raise ImportError(f"tilework needs torch >= {_floor}, this is torch {_torch.__version__}: "
                      f"pip install 'torch>={_floor}' (or your CUDA build)")

from .api import (
    batch_shares,
    clip_grad_norm_,
    clip_grad_value_,
    data_parallel_rank,
    estimate_memory,
    full_parameters,
    load,
    load_state_dict,
    parallelize,
    plan,
    save,
    state_dict,
    stats,
    unparallelize,
)
from .cluster.topology import Cluster, Host, Link, Topology
from .config.parallel import ParallelConfig
from .errors import UserError
from .parallel.rows.ahead import prefetch

__version__ = "0.1.0"
__all__ = ["parallelize", "unparallelize", "plan", "ParallelConfig", "clip_grad_norm_",
           "clip_grad_value_",
           "stats", "save", "load", "state_dict", "load_state_dict", "Cluster", "Host", "Link",
           "Topology", "UserError", "estimate_memory", "full_parameters", "data_parallel_rank",
           "prefetch", "batch_shares"]
