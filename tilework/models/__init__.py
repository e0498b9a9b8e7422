"""Reference workloads: ordinary single-device `nn.Module`s that know nothing of parallelism."""

from .cnn import SmallResNet
from .gpt import TinyGPT
from .lm import WordLM
from .recommender import DLRM

__all__ = ["WordLM", "SmallResNet", "DLRM", "TinyGPT"]
