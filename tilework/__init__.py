"""tilework: train a single-device PyTorch program across processes and machines.

    model, opt = tilework.parallelize(model, opt)   # inside a `tilework run` / torchrun process
"""

from .api import (clip_grad_norm_, clip_grad_value_, load, load_state_dict, parallelize, save,
                  state_dict, stats)
from .cluster import Cluster, Host, Link, Topology
from .errors import UserError

__version__ = "0.1.0"
__all__ = ["parallelize", "clip_grad_norm_", "clip_grad_value_", "stats", "save", "load", "state_dict", "load_state_dict", "Cluster", "Host", "Link", "Topology",
           "UserError"]
