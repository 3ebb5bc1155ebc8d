"""The user's own parallel text: one sentence per line, a source and a target file.

Whitespace tokenisation; one joint vocabulary for source and target (the models share
one ``vocab``), built from the training pairs only, with specials
``<pad>=0, <s>=1 (BOS), </s>=2 (EOS), <unk>=3``; other tokens follow by descending
frequency, ties broken alphabetically, so the vocabulary is deterministic.

Batches have the ``encoder_decoder`` layout of ``gradscope.train.tasks``. The training
split walks through a fresh seeded permutation of the pairs every epoch, so batch
``step`` is a pure function of ``(seed, step, batch_size)``; the validation split is
read in file order, wrapping around.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from gradscope.train.tasks import BOS, EOS, SPLITS, Batch, Task, batch_generator, pad_rows

SPECIALS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")
UNK = 3


@dataclass(frozen=True)
class Vocab:
    """Token ↔ id mapping. ``itos[i]`` is the token of id ``i``; ids 0–3 are ``SPECIALS``."""

    itos: tuple[str, ...]
    stoi: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stoi", {t: i for i, t in enumerate(self.itos)})

    @classmethod
    def build(cls, sentences: Sequence[Sequence[str]], *, min_freq: int = 1) -> Vocab:
        """Builds a vocabulary from tokenised sentences, keeping tokens seen ``min_freq`` times."""
        counts = Counter(tok for sent in sentences for tok in sent)
        kept = sorted((t for t, c in counts.items() if c >= min_freq and t not in SPECIALS),
                      key=lambda t: (-counts[t], t))
        return cls(SPECIALS + tuple(kept))

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """Maps tokens to ids; unknown tokens become ``<unk>`` (3)."""
        return [self.stoi.get(t, UNK) for t in tokens]

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Maps ids back to tokens."""
        return [self.itos[i] for i in ids]


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> list[tuple[list[str], list[str]]]:
    """Reads two aligned files into whitespace-tokenised pairs.

    Raises:
        ValueError: a file is empty, or the files have different line counts (the
            message names both files and their counts).
    """
    src_lines = Path(src_path).read_text(encoding="utf-8").splitlines()
    tgt_lines = Path(tgt_path).read_text(encoding="utf-8").splitlines()
    for path, lines in ((src_path, src_lines), (tgt_path, tgt_lines)):
        if not any(line.strip() for line in lines):
            raise ValueError(f"parallel text file {str(path)!r} is empty")
    if len(src_lines) != len(tgt_lines):
        raise ValueError(f"parallel text files differ in line count: {str(src_path)!r} has {len(src_lines)} "
                         f"lines, {str(tgt_path)!r} has {len(tgt_lines)}")
    return [(s.split(), t.split()) for s, t in zip(src_lines, tgt_lines)]


class ParallelTextTask(Task):
    """An ``encoder_decoder`` task over encoded sentence pairs.

    Sources are truncated to ``max_len`` tokens, targets to ``max_len - 1`` (room for
    BOS/EOS). Pairs whose source line is empty are dropped (``n_dropped`` counts them)
    because an all-pad source has nothing to attend to.

    Attributes:
        vocab_table: the ``Vocab``; ``vocab`` is its size.
        pairs: ``{"train": [...], "valid": [...]}`` lists of ``(src ids, tgt ids)``.
    """

    name = "parallel_text"
    arch = "encoder_decoder"

    def __init__(self, vocab_table: Vocab, pairs: dict[str, list[tuple[Tensor, Tensor]]], *,
                 max_len: int, seed: int = 0, n_dropped: int = 0) -> None:
        super().__init__(vocab=len(vocab_table), max_len=max_len, pad_id=0, seed=seed)
        self.vocab_table, self.pairs, self.n_dropped = vocab_table, pairs, n_dropped

    def batch(self, split: str, step: int, batch_size: int) -> Batch:
        """Returns batch number ``step`` of ``split`` (``"test"`` reads the validation pairs)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        data = self.pairs["train" if split == "train" else "valid"]
        n = len(data)
        positions = range(step * batch_size, (step + 1) * batch_size)
        if split == "train":
            chosen = [data[self._permutation(p // n)[p % n]] for p in positions]
        else:
            chosen = [data[p % n] for p in positions]
        bos, eos = torch.tensor([BOS]), torch.tensor([EOS])
        src = pad_rows([s for s, _ in chosen], self.pad_id)
        tgt_in = pad_rows([torch.cat([bos, t]) for _, t in chosen], self.pad_id)
        tgt_out = pad_rows([torch.cat([t, eos]) for _, t in chosen], self.pad_id)
        return src, tgt_in, tgt_out

    def _permutation(self, epoch: int) -> list[int]:
        return _epoch_permutation(self.seed, epoch, len(self.pairs["train"]))

    def __repr__(self) -> str:
        sizes = {k: len(v) for k, v in self.pairs.items()}
        return f"ParallelTextTask(vocab={self.vocab}, max_len={self.max_len}, pairs={sizes}, seed={self.seed})"


@lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, n: int) -> list[int]:
    return torch.randperm(n, generator=batch_generator("parallel_text", seed, "epoch", epoch)).tolist()


def load_parallel_text(src_path: str | Path, tgt_path: str | Path, *, valid_src: str | Path | None = None,
                       valid_tgt: str | Path | None = None, max_len: int = 128, seed: int = 0,
                       valid_fraction: float = 0.05, min_freq: int = 1) -> ParallelTextTask:
    """Loads parallel text files into a task with the built-in batch interface.

    Args:
        src_path: training source file, one sentence per line.
        tgt_path: training target file, aligned line by line with ``src_path``.
        valid_src: validation source file; give both ``valid_src`` and ``valid_tgt`` or neither.
        valid_tgt: validation target file.
        max_len: longest batch tensor (sources truncated to ``max_len``, targets to ``max_len - 1``).
        seed: shuffling seed (and the held-out split when no validation files are given).
        valid_fraction: without validation files, this seeded fraction of the training
            pairs (at least one) is held out as validation and kept out of the vocabulary.
        min_freq: tokens rarer than this in the training pairs become ``<unk>``.

    Returns:
        A ``ParallelTextTask``.

    Raises:
        ValueError: empty files, mismatched line counts, only one validation file given,
            ``max_len < 2`` or ``valid_fraction`` outside ``[0, 1)``, or nothing left to train on.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    if (valid_src is None) != (valid_tgt is None):
        raise ValueError("give both valid_src and valid_tgt, or neither")
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    raw = read_parallel(src_path, tgt_path)
    kept = [p for p in raw if p[0]]
    n_dropped = len(raw) - len(kept)
    if valid_src is not None:
        train_raw, valid_raw = kept, [p for p in read_parallel(valid_src, valid_tgt) if p[0]]
    else:
        n_valid = max(1, round(valid_fraction * len(kept)))
        order = torch.randperm(len(kept), generator=batch_generator("parallel_text", seed, "holdout")).tolist()
        held = set(order[:n_valid])
        train_raw = [p for i, p in enumerate(kept) if i not in held]
        valid_raw = [kept[i] for i in sorted(held)]
    if not train_raw or not valid_raw:
        raise ValueError(f"{str(src_path)!r}: need at least one training and one validation pair with a "
                         f"non-empty source; got {len(train_raw)} and {len(valid_raw)}")
    vocab = Vocab.build([s for pair in train_raw for s in pair], min_freq=min_freq)

    def encode(pairs: list[tuple[list[str], list[str]]]) -> list[tuple[Tensor, Tensor]]:
        return [(torch.tensor(vocab.encode(s[:max_len]), dtype=torch.long),
                 torch.tensor(vocab.encode(t[: max_len - 1]), dtype=torch.long)) for s, t in pairs]

    return ParallelTextTask(vocab, {"train": encode(train_raw), "valid": encode(valid_raw)},
                            max_len=max_len, seed=seed, n_dropped=n_dropped)
