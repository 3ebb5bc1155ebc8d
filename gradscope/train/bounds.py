"""What a task allows: its chance loss and its floor under the loss it trains with.

Both are computed from the task's definition (its token distribution), never from a run,
under the label-smoothed cross entropy of :func:`gradscope.train.label_smoothed_loss`
(torch's convention: the smoothed target of token y is ``q_y = (1 - ε)·onehot(y) + ε/V``
over all V classes), with the loss a mean over target tokens (token-weighted).

- **floor**: the expected loss of the best predictor that sees the input. Cross entropy
  ``H(q, p)`` is minimised by ``p = q`` (Gibbs' inequality), so a task whose target is a
  function of its input (``reverse``, ``sort_noisy``) has the floor ``H(q_y)``, the same for
  every token; a stochastic target (``markov_lm``) has ``E[H((1 - ε)·P(·|prefix) + ε/V)]``.
- **chance**: the expected loss of the best input-independent predictor, one distribution
  ``p`` for every target position. With ``m`` the token-weighted marginal of the target
  tokens (expected count of each id over expected count of tokens), the expected loss is
  ``H((1 - ε)·m + ε/V, p)``, minimised at ``p = (1 - ε)·m + ε/V``: chance = its entropy.
- **chance accuracy**: the token accuracy of that predictor, ``max(m)``.

A run's *gap closed* is ``(chance - loss) / (chance - floor)``: 0 at chance, 1 at the floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradscope.train.tasks import EOS, MarkovLMTask, ReverseTask, SortNoisyTask, Task


@dataclass(frozen=True, kw_only=True)
class LossBounds:
    """Chance and floor of one task under one label smoothing (nats per target token).

    Attributes:
        chance: loss of the best input-independent predictor.
        floor: loss of the best predictor that sees the input.
        chance_accuracy: token accuracy of the best input-independent predictor.
        smoothing: the label smoothing ε they hold for.
    """

    chance: float
    floor: float
    chance_accuracy: float
    smoothing: float

    def gap_closed(self, loss: float) -> float:
        """``(chance - loss) / (chance - floor)``: 0 at chance, 1 at the floor."""
        return (self.chance - loss) / (self.chance - self.floor)


def smoothed_entropy(probs: np.ndarray, smoothing: float) -> float:
    """Entropy (nats) of ``(1 - ε)·probs + ε/V`` over the last axis, V = ``probs.shape[-1]``;
    a mean over leading axes is left to the caller (returns the entropy of each row summed as
    given: a 1-D ``probs`` gives one number)."""
    q = (1.0 - smoothing) * np.asarray(probs, dtype=np.float64) + smoothing / probs.shape[-1]
    return float(-(q * np.log(q, where=q > 0, out=np.zeros_like(q))).sum())


def _bounds_of_marginal(marginal: np.ndarray, floor: float, smoothing: float) -> LossBounds:
    return LossBounds(chance=smoothed_entropy(marginal, smoothing), floor=floor,
                      chance_accuracy=float(marginal.max()), smoothing=smoothing)


def _deterministic(task: Task, content: np.ndarray, mean_content: float, smoothing: float) -> LossBounds:
    """A target fully set by the input: ``content`` (V,) the distribution of a content target
    token, ``mean_content`` the expected count of content tokens per target (plus one EOS)."""
    marginal = content * mean_content / (mean_content + 1.0)
    marginal[EOS] += 1.0 / (mean_content + 1.0)
    onehot = np.zeros(task.vocab)
    onehot[EOS] = 1.0
    return _bounds_of_marginal(marginal, smoothed_entropy(onehot, smoothing), smoothing)


def _lengths(task: Task) -> np.ndarray:
    """The content lengths a task draws, uniformly (``_SyntheticTask._lengths``)."""
    return np.arange(task.min_len, task.max_len - task._overhead + 1)


def _markov_lm(task: MarkovLMTask, smoothing: float) -> LossBounds:
    """Exact over positions: token t (1-based) of ``s + [EOS]`` exists when the length L >= t - 1;
    it is EOS with the hazard P(L = t - 1 | L >= t - 1), else the chain's next state."""
    vocab, ids = task.vocab, task.content_ids.numpy()
    n = len(ids)
    trans = np.zeros((n, n))
    succ, prob = task.successors.numpy(), task.transition.numpy().astype(np.float64)
    for s in range(n):
        np.add.at(trans[s], succ[s], prob[s])
    lengths = _lengths(task)
    p_len = np.full(len(lengths), 1.0 / len(lengths))
    state = np.full(n, 1.0 / n)  # distribution of the state of content token t (t = 1: uniform)
    counts, floor_sum, tokens = np.zeros(vocab), 0.0, 0.0
    for t in range(1, int(lengths.max()) + 2):
        reach = p_len[lengths >= t - 1].sum()  # P(position t exists) = P(L >= t - 1)
        hazard = p_len[lengths == t - 1].sum() / reach if t > 1 else 0.0
        per_state = np.zeros((n, vocab))  # next-token distribution given the last state
        rows = trans if t > 1 else np.full((n, n), 1.0 / n)
        per_state[:, ids] = (1.0 - hazard) * rows
        per_state[:, EOS] = hazard
        prev = state if t > 1 else np.full(n, 1.0 / n)
        q = (1.0 - smoothing) * per_state + smoothing / vocab
        entropies = -(q * np.log(q)).sum(-1)
        floor_sum += reach * float(prev @ entropies)
        counts += reach * (prev @ per_state)
        tokens += reach
        if t > 1:
            state = state @ trans
    return _bounds_of_marginal(counts / tokens, float(floor_sum / tokens), smoothing)


def loss_bounds(task: Task, smoothing: float = 0.1) -> LossBounds:
    """The chance loss, floor and chance accuracy of ``task`` under ``smoothing`` (module docstring).

    Args:
        task: a built-in ``reverse``, ``sort_noisy`` or ``markov_lm`` task.
        smoothing: the label smoothing ε the runs train with.

    Raises:
        NotImplementedError: a task whose bounds are not derived here (``markov_mlm``: the
            posterior of a masked token given both neighbours; parallel text: no definition).
    """
    if isinstance(task, MarkovLMTask) and task.arch == "decoder":
        return _markov_lm(task, smoothing)
    if isinstance(task, (ReverseTask, SortNoisyTask)):
        mean_len = float(_lengths(task).mean())
        ids = task.clean_ids if isinstance(task, SortNoisyTask) else task.content_ids
        content = np.zeros(task.vocab)
        if isinstance(task, ReverseTask):
            content[ids.numpy()] = task.content_probs.numpy()  # uniform, or Zipfian
        else:
            content[ids.numpy()] = 1.0 / len(ids)
        keep = 1.0 - task.noise if isinstance(task, SortNoisyTask) else 1.0  # noise tokens are dropped
        return _deterministic(task, content, keep * mean_len, smoothing)
    raise NotImplementedError(f"loss_bounds: no chance loss and floor derived for {task!r}")
