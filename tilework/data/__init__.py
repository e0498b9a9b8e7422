"""Data that needs no download, and deterministic sharding of any dataset over ranks."""

from .corpus import Corpus, stdlib_corpus
from .sharding import ShardedBatches
from .synthetic import ClickLogs, SyntheticImages, TokenSequences, zipf_tokens

__all__ = ["Corpus", "stdlib_corpus", "ShardedBatches", "ClickLogs", "SyntheticImages",
           "TokenSequences", "zipf_tokens"]
