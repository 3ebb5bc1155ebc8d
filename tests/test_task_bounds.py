"""Each task's chance loss and floor (gradscope.train.bounds) against a brute-force computation
on the task's own batches: the best input-independent predictor fitted by L-BFGS on the
training loss, and the best input-aware predictor read from the batches' empirical
conditional frequencies (or, for a deterministic task, a predictor that solves it)."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

from gradscope.train import label_smoothed_loss, make_task
from gradscope.train.bounds import loss_bounds, smoothed_entropy

TASKS = [("reverse", {}), ("reverse", {"zipf": 1.1}), ("sort_noisy", {}), ("markov_lm", {"branching": 3})]
EPS = 0.1


def targets(task, n_batches: int = 150, batch: int = 64) -> torch.Tensor:
    return torch.cat([task.targets(task.batch("train", i, batch)).flatten() for i in range(n_batches)])


def fitted_chance(task, ys: torch.Tensor) -> float:
    """The lowest training loss of one logit vector for every position, found by L-BFGS."""
    logits = torch.zeros(task.vocab, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([logits], max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = label_smoothed_loss(logits.expand(len(ys), -1), ys, pad_id=task.pad_id, smoothing=EPS)
        loss.backward()
        return loss

    opt.step(closure)
    return float(closure().detach())


@pytest.mark.parametrize(("name", "options"), TASKS)
def test_chance_is_the_best_input_independent_loss(name, options):
    task = make_task(name, vocab=24, max_len=10, **options)
    bounds, ys = loss_bounds(task, EPS), targets(task)
    assert bounds.chance == pytest.approx(fitted_chance(task, ys), abs=0.01)
    counts = torch.bincount(ys[ys != task.pad_id], minlength=task.vocab).double()
    assert bounds.chance_accuracy == pytest.approx(float(counts.max() / counts.sum()), abs=0.01)
    assert bounds.floor < bounds.chance < np.log(task.vocab)


@pytest.mark.parametrize(("name", "options"), [("reverse", {}), ("reverse", {"zipf": 1.1}), ("sort_noisy", {})])
def test_floor_is_the_loss_of_a_predictor_that_solves_the_task(name, options):
    task = make_task(name, vocab=24, max_len=10, **options)
    bounds = loss_bounds(task, EPS)
    for i in range(5):
        src, _, tgt = task.batch("valid", i, 32)
        solved = []  # the target, computed from the source alone
        for row in src:
            content = row[row != task.pad_id]
            if name == "reverse":
                out = content.flip(0)
            else:
                out = content[~torch.isin(content, task.noise_ids)].sort().values
            solved.append(torch.cat([out, torch.tensor([2])]))
        guess = torch.zeros_like(tgt)
        for r, y in enumerate(solved):
            guess[r, : len(y)] = y
        assert torch.equal(guess[tgt != task.pad_id], tgt[tgt != task.pad_id])
        q = (1 - EPS) * torch.nn.functional.one_hot(guess, task.vocab).double() + EPS / task.vocab
        loss = label_smoothed_loss(q.log(), tgt, pad_id=task.pad_id, smoothing=EPS)
        assert float(loss) == pytest.approx(bounds.floor, abs=1e-6)  # (the loss is computed in float32)


def test_markov_floor_is_the_empirical_conditional_entropy():
    """Position and previous token are sufficient for the next token of markov_lm (a chain, a
    length drawn apart): the smoothed entropy of the empirical next-token frequencies in each
    (position, previous token) context, weighted by the context's share of tokens."""
    task = make_task("markov_lm", vocab=16, max_len=8, branching=3)
    contexts: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for i in range(600):
        tin, tout = task.batch("train", i, 64)
        for row_in, row_out in zip(tin.tolist(), tout.tolist()):
            for t, (prev, nxt) in enumerate(zip(row_in, row_out)):
                if nxt != task.pad_id:
                    contexts[(t, prev)][nxt] += 1
    total = sum(sum(c.values()) for c in contexts.values())
    brute = 0.0
    for counter in contexts.values():
        n = sum(counter.values())
        probs = np.zeros(task.vocab)
        for tok, k in counter.items():
            probs[tok] = k / n
        brute += n / total * smoothed_entropy(probs, EPS)
    bounds = loss_bounds(task, EPS)
    assert bounds.floor == pytest.approx(brute, abs=0.02)  # the empirical frequencies' own noise
    assert bounds.chance == pytest.approx(fitted_chance(task, targets(task)), abs=0.01)


def test_gap_closed_and_unsupported_tasks():
    bounds = loss_bounds(make_task("reverse", vocab=32, max_len=12), EPS)
    assert bounds.gap_closed(bounds.chance) == 0 and bounds.gap_closed(bounds.floor) == pytest.approx(1)
    with pytest.raises(NotImplementedError, match="MarkovMLMTask"):
        loss_bounds(make_task("markov_mlm", vocab=32, max_len=12))


def test_zipf_content_follows_its_law_and_zipf_0_keeps_the_uniform_draws():
    """The k-th content id's share of a Zipf(1.1) task's sources is ∝ k^-1.1 (counted here), and
    zipf=0 draws exactly the batches of a task made without the option."""
    task = make_task("reverse", vocab=300, max_len=12, zipf=1.1)
    src = torch.cat([task.batch("train", i, 64)[0].flatten() for i in range(300)])
    counts = torch.bincount(src[src != task.pad_id], minlength=task.vocab)[task.content_ids].double()
    ranks = torch.arange(1, len(task.content_ids) + 1, dtype=torch.float64)
    expected = ranks**-1.1 / (ranks**-1.1).sum()
    assert torch.allclose(counts[:5] / counts.sum(), expected[:5], rtol=0.05)  # the head: thousands of draws each
    plain, zero = make_task("reverse", vocab=32, max_len=12), make_task("reverse", vocab=32, max_len=12, zipf=0.0)
    for a, b in zip(plain.batch("train", 3, 8), zero.batch("train", 3, 8)):
        assert torch.equal(a, b)
    bounds = loss_bounds(task, EPS)
    assert bounds.chance < loss_bounds(make_task("reverse", vocab=300, max_len=12), EPS).chance  # skew lowers chance
    with pytest.raises(ValueError, match="zipf"):
        make_task("reverse", vocab=32, max_len=12, zipf=-1.0)
