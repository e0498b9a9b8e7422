"""A real text corpus with no download: the running interpreter's own standard-library sources.

Word-level tokens (identifiers, numbers, single punctuation marks), a vocabulary ordered by
frequency (id 0 is `<unk>` for words beyond `max_vocab`), cached on disk as .npy plus a word list,
so later runs load in milliseconds. Ordering by frequency is what the log-uniform negative sampler
of the sampled softmax assumes.
"""

from __future__ import annotations

import collections
import io
import json
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.atomic import write_atomic

_TOKEN = re.compile(r"[A-Za-z_]+|\d+|[^\sA-Za-z_\d]")
UNK = "<unk>"


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # int32 ids
    words: list[str]    # id -> word; words[0] == "<unk>"

    @property
    def vocab(self) -> int:
        return len(self.words)


def _source_files(root: Path) -> list[Path]:
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _build(root: Path, max_vocab: int) -> Corpus:
    words: list[str] = []
    for path in _source_files(root):
        words.extend(_TOKEN.findall(path.read_text(encoding="utf-8", errors="replace")))
    counts = collections.Counter(words)
    vocab = [UNK] + [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    vocab = vocab[:max_vocab]
    index = {w: i for i, w in enumerate(vocab)}
    ids = np.fromiter((index.get(w, 0) for w in words), dtype=np.int32, count=len(words))
    return Corpus(tokens=ids, words=vocab)


def stdlib_corpus(cache_dir: str | Path, max_vocab: int = 10_000) -> Corpus:
    """The standard-library corpus, built once per interpreter version and vocabulary size."""
    if max_vocab < 2:
        raise ValueError(f"max_vocab must be at least 2, got {max_vocab}")
    root = Path(sysconfig.get_paths()["stdlib"])
    tag = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-v{max_vocab}"
    cache = Path(cache_dir)
    ids_path, words_path = cache / f"{tag}.npy", cache / f"{tag}.json"
    if ids_path.exists() and words_path.exists():
        try:
            return Corpus(tokens=np.load(ids_path), words=json.loads(words_path.read_text()))
        except (ValueError, OSError, json.JSONDecodeError):
            pass  # a damaged cache is rebuilt below
    corpus = _build(root, max_vocab)
    cache.mkdir(parents=True, exist_ok=True)
    write_atomic(words_path, json.dumps(corpus.words))
    buffer = io.BytesIO()
    np.save(buffer, corpus.tokens)
    write_atomic(ids_path, buffer.getvalue())
    return corpus
