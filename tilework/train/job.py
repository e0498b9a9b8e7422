"""The job file (`tilework train job.toml`): which workload, its data, the loop, the parallel plan.

    workload = "lm"                  # lm | gpt | cnn | recommender
    [lm]    corpus = "stdlib", vocab = 10000, seq_len = 32, ...
    [gpt]   corpus = "stdlib", vocab = 10000, dim = 64, heads = 4, layers = 2, seq_len = 32
    [data]  batch_size = 32, scaling = "strong", seed = 0
    [train] steps = 200, optimizer = "adam", lr = 0.01, checkpoint_every = 50, out_dir = "runs/x"
    [parallel] mode = "hybrid", tp = 2, pp = 2, microbatches = 4, schedule = "1f1b", ...
    [parallel.layout] "blocks.layers.*.linear1" = "colwise", ...

Only the selected workload's table is read. Every key is checked; unknown keys are refused by name.
tp, pp and cp split the model itself (tilework/runtime/apply.py): only the gpt workload, a TinyGPT,
has the blocks they split, so the others refuse them here, before any worker starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..config import files as config
from ..config.files import check
from ..config.parallel import ParallelConfig

MAX_LAYERS = 256
MAX_SEED = 2**40  # workloads seed generators with seed * 1_000_003 + step, which must fit 64 bits


@dataclass
class LMJob:
    corpus: Literal["stdlib", "zipf"] = "stdlib"
    vocab: int = 10_000
    embed_dim: int = 64
    hidden: int = 128
    layers: int = 1
    seq_len: int = 32
    num_sampled: int = 0          # > 0: sampled softmax with this many shared negatives
    sparse: bool = True           # sparse embedding gradients (nn.Embedding(sparse=True))
    zipf_tokens: int = 1_000_000  # corpus = "zipf": length of the synthetic stream
    zipf_alpha: float = 1.1
    holdout: float = 0.02         # fraction of the corpus kept for perplexity
    eval_sequences: int = 256

    def __post_init__(self):
        check(self.vocab >= 2, "vocab", f"at least 2 words, got {self.vocab}")
        for name in ("embed_dim", "hidden", "layers", "seq_len", "zipf_tokens", "eval_sequences"):
            check(getattr(self, name) >= 1, name, f"at least 1, got {getattr(self, name)}")
        check(self.num_sampled >= 0, "num_sampled", f">= 0, got {self.num_sampled}")
        # torch builds an LSTM layer by layer: 1,000 take a second even on the meta device.
        check(self.layers <= MAX_LAYERS, "layers", f"at most {MAX_LAYERS}, got {self.layers}")
        check(0 < self.holdout < 0.5, "holdout", f"a fraction in (0, 0.5), got {self.holdout}")
        check(self.zipf_alpha > 0, "zipf_alpha", f"> 0, got {self.zipf_alpha}")


@dataclass
class GPTJob:
    """TinyGPT (tilework/models/gpt.py) on the lm workload's token stream, its loss the
    held-out next-token cross-entropy."""
    corpus: Literal["stdlib", "zipf"] = "stdlib"
    vocab: int = 10_000
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 32
    zipf_tokens: int = 1_000_000  # corpus = "zipf": length of the synthetic stream
    zipf_alpha: float = 1.1
    holdout: float = 0.02         # fraction of the corpus kept for the held-out loss
    eval_sequences: int = 256

    def __post_init__(self):
        check(self.vocab >= 2, "vocab", f"at least 2 words, got {self.vocab}")
        for name in ("dim", "heads", "layers", "seq_len", "zipf_tokens", "eval_sequences"):
            check(getattr(self, name) >= 1, name, f"at least 1, got {getattr(self, name)}")
        check(self.dim % self.heads == 0, "heads",
              f"a divisor of dim ({self.dim}), got {self.heads}")
        # nn.TransformerEncoder deep-copies its layer per block: the same bound as the LSTM's.
        check(self.layers <= MAX_LAYERS, "layers", f"at most {MAX_LAYERS}, got {self.layers}")
        check(0 < self.holdout < 0.5, "holdout", f"a fraction in (0, 0.5), got {self.holdout}")
        check(self.zipf_alpha > 0, "zipf_alpha", f"> 0, got {self.zipf_alpha}")


@dataclass
class CNNJob:
    samples: int = 4096
    num_classes: int = 10
    image_size: int = 16
    width: int = 16
    blocks: int = 2

    def __post_init__(self):
        for name in ("samples", "image_size", "width", "blocks"):
            check(getattr(self, name) >= 1, name, f"at least 1, got {getattr(self, name)}")
        check(self.num_classes >= 2, "num_classes", f"at least 2, got {self.num_classes}")


@dataclass
class RecommenderJob:
    samples: int = 65_536
    table_sizes: list[int] = field(default_factory=lambda: [20_000, 5_000, 1_000])
    dense_features: int = 8
    embed_dim: int = 16
    zipf_alpha: float = 1.1
    sparse: bool = True

    def __post_init__(self):
        check(len(self.table_sizes) >= 1 and all(n >= 1 for n in self.table_sizes),
              "table_sizes", f"a non-empty list of positive table sizes, got {self.table_sizes}")
        for name in ("samples", "dense_features", "embed_dim"):
            check(getattr(self, name) >= 1, name, f"at least 1, got {getattr(self, name)}")


@dataclass
class DataJob:
    batch_size: int = 32          # global under strong scaling, per rank under weak scaling
    scaling: Literal["strong", "weak"] = "strong"
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self):
        check(self.batch_size >= 1, "batch_size", f"at least 1, got {self.batch_size}")
        check(0 <= self.seed < MAX_SEED, "seed", f"0 <= seed < 2**40, got {self.seed}")


@dataclass
class TrainJob:
    steps: int = 200
    optimizer: Literal["sgd", "adagrad", "adam"] = "adam"
    lr: float = 0.01
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0           # 0: evaluate at the start and the end only
    checkpoint_every: int = 0     # 0: none; else every N steps and after the last
    keep_checkpoints: int = 2
    out_dir: str = "runs/job"     # checkpoints/ and metrics.jsonl go here

    def __post_init__(self):
        check(self.steps >= 1, "steps", f"at least 1, got {self.steps}")
        check(self.lr > 0, "lr", f"a positive learning rate, got {self.lr}")
        check(0 <= self.seed < MAX_SEED, "seed", f"0 <= seed < 2**40, got {self.seed}")
        check(self.log_every >= 1, "log_every", f"at least 1, got {self.log_every}")
        for name in ("eval_every", "checkpoint_every"):
            check(getattr(self, name) >= 0, name, f">= 0, got {getattr(self, name)}")
        check(self.keep_checkpoints >= 1, "keep_checkpoints",
              f"at least 1, got {self.keep_checkpoints}")


@dataclass
class Job:
    workload: Literal["lm", "gpt", "cnn", "recommender"] = "lm"
    lm: LMJob = field(default_factory=LMJob)
    gpt: GPTJob = field(default_factory=GPTJob)
    cnn: CNNJob = field(default_factory=CNNJob)
    recommender: RecommenderJob = field(default_factory=RecommenderJob)
    data: DataJob = field(default_factory=DataJob)
    train: TrainJob = field(default_factory=TrainJob)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache_dir: str | None = None  # where the corpus cache lives; default ~/.cache/tilework

    def __post_init__(self):
        p = self.parallel
        every, ckpt = p.sync_every, self.train.checkpoint_every
        # Between syncs every rank's parameters are its own: a checkpoint there would hold rank
        # 0's alone, and the others' work since the sync would be lost on resume.
        check(p.sync != "diloco" or ckpt % every == 0, "train.checkpoint_every",
              f"a multiple of parallel.sync_every ({every}) under sync = \"diloco\": "
              f"checkpoints at the syncs, where every rank holds the same parameters; got {ckpt}")
        if not p.model_parallel:
            return
        axis = next(a for a in ("tp", "pp", "cp") if getattr(p, a) > 1)
        check(self.workload == "gpt", f"parallel.{axis}",
              f"1 for the {self.workload!r} workload: tp, pp and cp split a transformer's "
              "blocks, which only workload = \"gpt\" has")
        from ..parallel.tensor.layout import STYLES, style_specs

        for pattern, style in (p.layout or {}).items():
            check(isinstance(style, str) and style_specs(style) is not None,
                  f"parallel.layout.{pattern}",
                  f"one of {', '.join(STYLES)}, got {style!r}")
        g = self.gpt
        check(g.heads % p.tp == 0, "parallel.tp",
              f"a divisor of gpt.heads ({g.heads}): attention is split by heads, got {p.tp}")
        # The built-in layout splits the vocabulary and the MLP; a job's own layout may not.
        check(p.layout is not None or (g.dim * 4 % p.tp == 0 and g.vocab % p.tp == 0),
              "parallel.tp",
              f"a divisor of gpt.vocab ({g.vocab}) and of the MLP width 4 x gpt.dim "
              f"({4 * g.dim}), got {p.tp}")
        check(g.seq_len % (2 * p.cp) == 0, "parallel.cp",
              f"cp with 2 x cp dividing gpt.seq_len ({g.seq_len}): the sequence is cut into "
              f"2 x cp balanced chunks, got {p.cp}")
        stages = p.pp * (p.stages_per_rank if p.schedule == "interleaved" else 1)
        check(g.layers >= stages, "parallel.pp",
              f"at most gpt.layers ({g.layers}) pipeline stages of one block or more, got "
              f"{stages} (pp = {p.pp}" + (f" x stages_per_rank = {p.stages_per_rank})"
                                           if stages != p.pp else ")"))

    @classmethod
    def load(cls, path: str | Path) -> "Job":
        return config.load(cls, path)

    def fingerprint(self) -> dict:
        """What a checkpoint must match to be resumed: the model and its data, not the loop."""
        chosen = dataclasses.asdict(getattr(self, self.workload))
        return {"workload": self.workload, **{f"{self.workload}.{k}": v for k, v in chosen.items()},
                "data.batch_size": self.data.batch_size, "data.seed": self.data.seed,
                "train.optimizer": self.train.optimizer}
