"""Built-in synthetic tasks: no download, fully deterministic.

A batch is a pure function of ``(task seed, split, step, batch_size)``: each call seeds a
fresh ``torch.Generator`` from a hash of those values, so a resumed run sees exactly the
batches an uninterrupted run would have seen, whatever happened in between.

Token conventions (all tasks):
    ``pad_id`` (default 0) pads; ``BOS=1`` starts a target; ``EOS=2`` ends it; content
    tokens are ``3..vocab-1`` (minus ``pad_id`` if it lies there). ``markov_mlm``
    additionally reserves ``vocab - 1`` as its ``[MASK]`` token.

Batch layouts (last element is always the target, the rest are the model's inputs):
    ``encoder_decoder``: ``(src (B, S), tgt_in (B, T), tgt_out (B, T))`` with
        ``tgt_in = [BOS] + y`` and ``tgt_out = y + [EOS]``.
    ``decoder``: ``(tokens_in (B, T), tokens_out (B, T))`` = ``([BOS] + s, s + [EOS])``.
    ``encoder``: ``(tokens_masked (B, T), labels (B, T))``, labels ``pad_id`` where not
        masked.

Tensors are padded with ``pad_id`` to the longest sequence of the batch, never beyond
``max_len``. Content lengths are drawn uniformly from ``[min_len, max_len - 1]`` so that
``[BOS] + y`` fits in ``max_len`` (``[min_len, max_len - 2]`` for ``markov_mlm``, whose
rows carry both BOS and EOS).

Registry: ``TASKS`` maps names to classes; ``make_task(name, ...)`` builds one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

BOS = 1
EOS = 2
FIRST_CONTENT = 3
SPLITS: tuple[str, ...] = ("train", "valid", "test")

Batch = tuple[Tensor, ...]


def batch_generator(*parts: object) -> torch.Generator:
    """Returns a CPU generator seeded by a stable hash of ``parts`` (not Python's ``hash``)."""
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def pad_rows(rows: list[Tensor], pad_id: int) -> Tensor:
    """Stacks 1-D LongTensors into (B, longest), right-padded with ``pad_id``."""
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


class Task:
    """Base class: the arch-agnostic interface the training loop relies on.

    Attributes:
        name: registry name.
        arch: ``"encoder_decoder"``, ``"decoder"`` or ``"encoder"``.
        vocab: vocabulary size the model must have.
        max_len: longest sequence a batch may contain (the model's ``max_len``).
        pad_id: padding id; the loss ignores it.
    """

    name: ClassVar[str] = ""
    arch: ClassVar[str] = ""

    def __init__(self, *, vocab: int, max_len: int, pad_id: int = 0, seed: int = 0) -> None:
        if pad_id in (BOS, EOS) or not 0 <= pad_id < vocab:
            raise ValueError(f"pad_id={pad_id} must be in [0, vocab) and differ from BOS=1 and EOS=2")
        self.vocab, self.max_len, self.pad_id, self.seed = vocab, max_len, pad_id, seed

    def batch(self, split: str, step: int, batch_size: int) -> Batch:
        """Returns batch number ``step`` of ``split``; a pure function of its arguments.

        Args:
            split: one of ``SPLITS``.
            step: batch index (any int >= 0); the training loop passes the 1-based step.
            batch_size: number of sequences B.

        Returns:
            A tuple of (B, ·) LongTensors on the CPU, laid out as in the module docstring.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self._make_batch(batch_generator(self.name, self.seed, split, step), batch_size)

    def _make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        raise NotImplementedError

    @staticmethod
    def model_inputs(batch: Batch) -> Batch:
        """The tensors passed positionally to the model: every element but the last."""
        return tuple(batch[:-1])

    @staticmethod
    def targets(batch: Batch) -> Tensor:
        """The (B, T) target ids of the batch: its last element."""
        return batch[-1]

    def __repr__(self) -> str:
        """The class and every option that sets the data (two tasks with one repr draw the same batches)."""
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if isinstance(v, (bool, int, float, str)))
        return f"{type(self).__name__}({options})"


class _SyntheticTask(Task):
    """Shared pieces: content-token alphabet and length sampling.

    ``_overhead`` is the number of specials added around a content sequence in the
    longest batch tensor, so content lengths are drawn from
    ``[min_len, max_len - _overhead]``.
    """

    _overhead: ClassVar[int] = 1

    def __init__(self, *, vocab: int, max_len: int, pad_id: int = 0, seed: int = 0, min_len: int = 2,
                 reserved: int = 0) -> None:
        super().__init__(vocab=vocab, max_len=max_len, pad_id=pad_id, seed=seed)
        if not 1 <= min_len <= max_len - self._overhead:
            raise ValueError(f"min_len={min_len} must be in [1, max_len - {self._overhead}] with max_len={max_len}")
        self.min_len = min_len
        ids = [t for t in range(FIRST_CONTENT, vocab - reserved) if t != pad_id]
        if len(ids) < 2:
            raise ValueError(f"vocab={vocab} leaves {len(ids)} content tokens for {self.name!r}; need >= 2")
        self.content_ids = torch.tensor(ids, dtype=torch.long)

    def _lengths(self, gen: torch.Generator, batch_size: int) -> Tensor:
        high = self.max_len - self._overhead + 1
        return torch.randint(self.min_len, high, (batch_size,), generator=gen)  # (B,)

    def _random_tokens(self, gen: torch.Generator, shape: tuple[int, ...], ids: Tensor | None = None) -> Tensor:
        ids = self.content_ids if ids is None else ids
        return ids[torch.randint(len(ids), shape, generator=gen)]

    def _seq2seq(self, sources: list[Tensor], targets: list[Tensor]) -> Batch:
        bos, eos = torch.tensor([BOS]), torch.tensor([EOS])
        src = pad_rows(sources, self.pad_id)  # (B, S)
        tgt_in = pad_rows([torch.cat([bos, y]) for y in targets], self.pad_id)  # (B, T)
        tgt_out = pad_rows([torch.cat([y, eos]) for y in targets], self.pad_id)  # (B, T)
        return src, tgt_in, tgt_out


class ReverseTask(_SyntheticTask):
    """Seq2seq: the target is the source reversed. Lengths uniform in ``[min_len, max_len-1]``.

    Content tokens are uniform (``zipf=0``, default) or Zipfian, closer to a translation
    corpus's word frequencies: the k-th content id (k = 1, 2, ...) has probability ∝ k^-zipf.
    """

    name = "reverse"
    arch = "encoder_decoder"

    def __init__(self, *, vocab: int, max_len: int, pad_id: int = 0, seed: int = 0, min_len: int = 2,
                 zipf: float = 0.0) -> None:
        super().__init__(vocab=vocab, max_len=max_len, pad_id=pad_id, seed=seed, min_len=min_len)
        if not (zipf >= 0.0 and zipf < float("inf")):
            raise ValueError(f"zipf={zipf} must be a finite number >= 0")
        self.zipf = float(zipf)
        ranks = torch.arange(1, len(self.content_ids) + 1, dtype=torch.float64)
        weights = ranks ** -self.zipf
        self.content_probs = weights / weights.sum()  # (n,) probability of each content id

    def _make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        lengths = self._lengths(gen, batch_size).tolist()
        if self.zipf:
            sources = [self.content_ids[torch.multinomial(self.content_probs, n, replacement=True, generator=gen)]
                       for n in lengths]
        else:  # (uniform: the draws of the tables committed before the option)
            sources = [self._random_tokens(gen, (n,)) for n in lengths]
        return self._seq2seq(sources, [s.flip(0) for s in sources])


class SortNoisyTask(_SyntheticTask):
    """Seq2seq: sort the source, dropping noise tokens.

    The last ``n_noise`` content ids are *noise* tokens. Each source position is replaced
    by a uniformly drawn noise token with probability ``noise``; the target is the
    ascending sort of the remaining (non-noise) source tokens, so the model must both
    filter and sort. A source made only of noise has the empty target ``[EOS]``.
    """

    name = "sort_noisy"
    arch = "encoder_decoder"

    def __init__(self, *, vocab: int, max_len: int, pad_id: int = 0, seed: int = 0, min_len: int = 2,
                 noise: float = 0.2, n_noise: int = 2) -> None:
        super().__init__(vocab=vocab, max_len=max_len, pad_id=pad_id, seed=seed, min_len=min_len)
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise={noise} must be in [0, 1)")
        if not 1 <= n_noise <= len(self.content_ids) - 1:
            raise ValueError(f"n_noise={n_noise} must be in [1, {len(self.content_ids) - 1}] for vocab={vocab}")
        self.noise, self.n_noise = noise, n_noise
        self.noise_ids, self.clean_ids = self.content_ids[-n_noise:], self.content_ids[:-n_noise]

    def _make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        lengths = self._lengths(gen, batch_size).tolist()
        sources, targets = [], []
        for n in lengths:
            clean = self._random_tokens(gen, (n,), self.clean_ids)
            is_noise = torch.rand(n, generator=gen) < self.noise
            src = torch.where(is_noise, self._random_tokens(gen, (n,), self.noise_ids), clean)
            sources.append(src)
            targets.append(clean[~is_noise].sort().values)
        return self._seq2seq(sources, targets)


class MarkovLMTask(_SyntheticTask):
    """Decoder LM on a random sparse Markov chain over the content tokens.

    The chain is fixed by ``seed``: every state has ``branching`` distinct successors
    with random probabilities (so the best achievable loss is the chain's entropy rate,
    at most ``ln(branching)`` nats per token, plus the uniform first token). Sequences
    ``s`` start at a uniform state; the batch is ``([BOS] + s, s + [EOS])``.
    """

    name = "markov_lm"
    arch = "decoder"
    _reserved: ClassVar[int] = 0

    def __init__(self, *, vocab: int, max_len: int, pad_id: int = 0, seed: int = 0, min_len: int = 2,
                 branching: int = 2) -> None:
        super().__init__(vocab=vocab, max_len=max_len, pad_id=pad_id, seed=seed, min_len=min_len,
                         reserved=self._reserved)
        n = len(self.content_ids)
        if not 1 <= branching <= n:
            raise ValueError(f"branching={branching} must be in [1, {n}] for vocab={vocab}")
        self.branching = branching
        gen = batch_generator(self.name, seed, "chain")
        self.successors = torch.stack([torch.randperm(n, generator=gen)[:branching] for _ in range(n)])  # (n, k)
        weights = torch.rand(n, branching, generator=gen) + 0.1
        self.transition = weights / weights.sum(-1, keepdim=True)  # (n, k), rows sum to 1

    def sequences(self, gen: torch.Generator, batch_size: int) -> list[Tensor]:
        """Draws ``batch_size`` chain sequences of content ids with random lengths."""
        lengths = self._lengths(gen, batch_size)
        width = int(lengths.max())
        states = torch.empty(batch_size, width, dtype=torch.long)  # indices into content_ids
        states[:, 0] = torch.randint(len(self.content_ids), (batch_size,), generator=gen)
        for t in range(1, width):
            prev = states[:, t - 1]
            pick = torch.multinomial(self.transition[prev], 1, generator=gen).squeeze(1)  # (B,)
            states[:, t] = self.successors[prev, pick]
        tokens = self.content_ids[states]  # (B, width)
        return [tokens[i, :n] for i, n in enumerate(lengths.tolist())]

    def _make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        seqs = self.sequences(gen, batch_size)
        bos, eos = torch.tensor([BOS]), torch.tensor([EOS])
        tokens_in = pad_rows([torch.cat([bos, s]) for s in seqs], self.pad_id)
        tokens_out = pad_rows([torch.cat([s, eos]) for s in seqs], self.pad_id)
        return tokens_in, tokens_out


class MarkovMLMTask(MarkovLMTask):
    """Encoder masked LM on the ``markov_lm`` chain (BERT-style, masking only).

    Sequences are ``[BOS] + s + [EOS]`` (at most ``max_len`` long); each content position
    (never BOS, EOS or pad) is masked with probability ``mask_prob`` (default 0.15); a row
    that drew no mask gets one at a random content position, so no row is label-free
    (which lifts the mask rate of short rows a little above ``mask_prob``).
    Masked positions become ``mask_id = vocab - 1`` (reserved, never a content token);
    ``labels`` hold the original id there and ``pad_id`` elsewhere. No 80/10/10
    random/keep replacement.
    """

    name = "markov_mlm"
    arch = "encoder"
    _reserved: ClassVar[int] = 1
    _overhead: ClassVar[int] = 2  # BOS and EOS

    def __init__(self, *, vocab: int, max_len: int, pad_id: int = 0, seed: int = 0, min_len: int = 2,
                 branching: int = 2, mask_prob: float = 0.15) -> None:
        super().__init__(vocab=vocab, max_len=max_len, pad_id=pad_id, seed=seed, min_len=min_len,
                         branching=branching)
        if not 0.0 < mask_prob <= 1.0:
            raise ValueError(f"mask_prob={mask_prob} must be in (0, 1]")
        self.mask_prob, self.mask_id = mask_prob, vocab - 1

    def _make_batch(self, gen: torch.Generator, batch_size: int) -> Batch:
        bos, eos = torch.tensor([BOS]), torch.tensor([EOS])
        tokens = pad_rows([torch.cat([bos, s, eos]) for s in self.sequences(gen, batch_size)], self.pad_id)
        content = (tokens != self.pad_id) & (tokens != BOS) & (tokens != EOS)  # (B, T)
        mask = (torch.rand(tokens.shape, generator=gen) < self.mask_prob) & content
        forced = (torch.rand(tokens.shape, generator=gen) * content).argmax(-1)  # a random content position per row
        mask[torch.arange(batch_size), forced] |= ~mask.any(-1)  # only rows that got no mask
        masked = torch.where(mask, torch.full_like(tokens, self.mask_id), tokens)
        labels = torch.where(mask, tokens, torch.full_like(tokens, self.pad_id))
        return masked, labels


TASKS: dict[str, Callable[..., Task]] = {
    cls.name: cls for cls in (ReverseTask, SortNoisyTask, MarkovLMTask, MarkovMLMTask)
}


def make_task(name: str, *, vocab: int, max_len: int, pad_id: int = 0, seed: int = 0, **options: object) -> Task:
    """Builds a built-in task by name.

    Args:
        name: a key of ``TASKS`` (``reverse``, ``sort_noisy``, ``markov_lm``, ``markov_mlm``).
        vocab: vocabulary size, specials included.
        max_len: longest sequence any batch tensor may have.
        pad_id: padding id (default 0).
        seed: task seed; fixes the data (and the Markov chain), independent of the
            training seed.
        **options: task-specific options (``min_len``, ``noise``, ``n_noise``,
            ``branching``, ``mask_prob``, ``zipf``); see each class.

    Returns:
        The task.

    Raises:
        ValueError: unknown name (the message lists valid names) or bad option values.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    return TASKS[name](vocab=vocab, max_len=max_len, pad_id=pad_id, seed=seed, **options)
