"""Outlier statistics of the tensor crossing each site, taken in the same forward pass as
``act_norm`` (the set ``"outliers"``): ``act_abs_max``, ``act_kurtosis`` and
``massive_act_count``. All three are ``site_value`` quantities
(:class:`~gradscope.recorder.quantities.quantity.Quantity`): traceable tensor ops, eager or
under ``torch.compile``, one device→host transfer per recorded step with everything else.

How a step's row combines its micro-steps, and how ranks combine (``rank = -1`` rows of
:func:`gradscope.distributed.global_rows`):

- ``act_abs_max``: the max (exact: the max over the concatenated micro-batches);
- ``massive_act_count``: the sum of the counts (each micro-batch judged against the median
  of its own hidden state, see :class:`MassiveActCount`);
- ``act_kurtosis``: exact over the concatenated micro-batches. Each call carries its
  element count, mean and central moments m₂, m₃, m₄, and the host combines them in float64
  with the pairwise update of Chan et al. 1979 / Pébay 2008 (:func:`combine_moments`), so the
  step's row is the kurtosis of all the step's tensors at a site taken as one. Ranks: each
  rank's rows are its own batch's and are not combined (``local``): a kurtosis is not a
  function of the ranks' kurtoses, and the table carries no moments.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from gradscope.recorder.quantities.quantity import Quantity
from gradscope.table.keys import Key


def elements(h: torch.Tensor) -> torch.Tensor:
    """The elements of ``h`` as one flat fp32 vector (detached); of a nested tensor
    (``nn.TransformerEncoder``'s fast path with a padding mask) its real tokens only."""
    h = h.detach()
    if h.is_nested:
        return torch.cat([x.flatten() for x in h.unbind()]).float()
    return h.flatten().float()


class _SiteStatistic(Quantity):
    """A statistic of the tensor crossing each site: nothing to measure without sites."""

    def nothing_to_measure(self, layout):
        return None if layout.sites else "the recorder found no site in the model"


class ActAbsMax(_SiteStatistic):
    """max |h| over the tensor crossing a site (the outlier statistic of torchtitan's tensor
    statistics and of Bondarenko et al. 2023)."""

    name = "act_abs_max"
    description = "max |h| over the tensor crossing a site (the step's row: the max over micro-batches)"
    paper = "Bondarenko et al. 2023 (outlier features); Sun et al. 2024"
    over_micro_steps = across_ranks = "max"

    def site_value(self, h):
        return elements(h).abs().amax()


class MassiveActCount(_SiteStatistic):
    """How many elements of the tensor crossing a site are *massive activations* in the sense
    of Sun et al. 2024 ("Massive Activations in Large Language Models", §2): an activation
    whose magnitude is larger than 100 and about 1,000 times larger than the median magnitude
    of its hidden state, i.e. ``|x| > 100`` and ``|x| > 1000 · median(|h|)``.

    The hidden state ``h`` here is the whole tensor of one call (the micro-batch, every
    token and feature: the paper looks at one sequence at a time, a site here sees the batch
    at once); the median is torch's (the lower of the two middle values). A step's row sums
    the micro-steps' counts, and ranks add up. The thresholds are :attr:`absolute` and
    :attr:`relative`.
    """

    name = "massive_act_count"
    description = ("count of elements with |x| > 100 and |x| > 1000·median(|h|) over the call's tensor (massive "
                   "activations); summed over micro-batches")
    paper = "Sun et al. 2024, §2"
    over_micro_steps = across_ranks = "sum"
    absolute = 100.0  # |x| above this (Sun et al. 2024)
    relative = 1000.0  # and above this many times the median |h|

    def site_value(self, h):
        a = elements(h).abs()
        median = a.median()
        return ((a > self.absolute) & (a > self.relative * median)).sum().float()


class Moments(NamedTuple):
    """Element count, mean and central moment sums M_k = Σ(x − mean)^k (k = 2, 3, 4) of a
    set of numbers, as float64 arrays of one shape (one entry per site)."""

    n: np.ndarray
    mean: np.ndarray
    m2: np.ndarray
    m3: np.ndarray
    m4: np.ndarray


def combine_moments(a: Moments, b: Moments) -> Moments:
    """The moments of the union of two sets from theirs, exactly (Pébay 2008, Eq. 3.1 and
    its M₃, M₄ updates; Chan, Golub & LeVeque 1979 for M₂). An empty set (n = 0) leaves the
    other unchanged."""
    n = a.n + b.n
    safe = np.where(n > 0, n, 1.0)
    d = b.mean - a.mean
    na, nb = a.n, b.n
    mean = a.mean + d * nb / safe
    m2 = a.m2 + b.m2 + d ** 2 * na * nb / safe
    m3 = a.m3 + b.m3 + d ** 3 * na * nb * (na - nb) / safe ** 2 + 3 * d * (na * b.m2 - nb * a.m2) / safe
    m4 = (a.m4 + b.m4 + d ** 4 * na * nb * (na ** 2 - na * nb + nb ** 2) / safe ** 3
          + 6 * d ** 2 * (na ** 2 * b.m2 + nb ** 2 * a.m2) / safe ** 2 + 4 * d * (na * b.m3 - nb * a.m3) / safe)
    return Moments(n, mean, m2, m3, m4)


def kurtosis(m: Moments) -> np.ndarray:
    """Pearson's kurtosis n·M₄/M₂² (3 for a Gaussian; NaN for a constant tensor)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(m.m2 > 0, m.n * m.m4 / np.where(m.m2 > 0, m.m2, 1.0) ** 2, np.nan)


class ActKurtosis(_SiteStatistic):
    """Kurtosis E[(x − μ)⁴] / E[(x − μ)²]² over every element of the tensor crossing a site
    (Pearson's: 3 for a Gaussian, large when a few outliers dominate; Bondarenko et al. 2023
    and Composer's activation monitor log it as the outlier signal). Each call's
    :meth:`site_value` is (n, mean, m₂, m₃, m₄), the central moments as means, from which the
    host builds the exact kurtosis of any set of calls (:func:`combine_moments`)."""

    name = "act_kurtosis"
    description = ("kurtosis E[(x−μ)⁴]/E[(x−μ)²]² over the elements of the tensor crossing a site (3 for a Gaussian); "
                   "the step's row: exact over all micro-batches, from their moments")
    paper = "Bondarenko et al. 2023; Composer's kurtosis monitor"
    site_value_size = 5

    def site_value(self, h):
        x = elements(h)
        mean = x.mean()
        d = x - mean
        d2 = d * d
        n = torch.full((), x.numel(), dtype=torch.float32, device=x.device)
        return torch.stack([n, mean, d2.mean(), (d2 * d).mean(), (d2 * d2).mean()])

    def merged_away(self, data):
        return data.merged is not None and bool(data.merged.any())

    def rows(self, data):
        values = data.user_values.get(self.name)
        if values is None or data.micro_steps == 0:
            return []
        slots = data.slots()
        seen = data.value_called[:, slots]
        if data.merged is not None:
            seen = seen & ~data.merged[slots]
        v = values[:, slots, :].astype(np.float64)  # (M, n, 5)
        n = np.where(seen, v[..., 0], 0.0)
        each = Moments(n, v[..., 1], v[..., 2] * n, v[..., 3] * n, v[..., 4] * n)  # means -> sums
        each = Moments(*(np.where(seen, f, 0.0) for f in each))
        total = Moments(*(f[0] for f in each))
        for m in range(1, data.micro_steps):
            total = combine_moments(total, Moments(*(f[m] for f in each)))
        step = kurtosis(total).tolist()
        got = seen.any(axis=0).tolist()
        if data.micro_steps == 1:
            return [(k, x) for k, x, g in zip(data.step_keys(self.name), step, got) if g]
        per_micro = kurtosis(each)  # (M, n)
        out = []
        for j, ((p, _, _, site), any_call) in enumerate(zip(data.slot_sites(), got)):
            if not any_call:
                continue
            out += [(Key(m, p.stack, p.layer, site, self.name, None, p.role), float(per_micro[m, j]))
                    for m in np.flatnonzero(seen[:, j]).tolist()]
            out.append((Key(-1, p.stack, p.layer, site, self.name, None, p.role), step[j]))
        return out
