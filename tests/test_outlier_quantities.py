"""The "outliers" set (issue 52): act_abs_max, act_kurtosis and massive_act_count at every
site, per micro-step and for the step, against references computed here from the tensors a
twin of the model (same weights, never seen by a Recorder) passes through its modules, on
models nobody here wrote, eagerly and under torch.compile(fullgraph=True).

One token's embedding is set to hold a 5000 in one feature, so that massive activations
(Sun et al. 2024: |x| > 100 and > 1000·median|h|) exist at some sites and the count is not
trivially 0. References: float64 from the very tensors (max |h|; kurtosis of the step's
micro-batches concatenated; the count with the lower median, sorted[(n − 1) // 2]).
"""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

import gradscope
from gradscope.recorder.quantities.outliers import Moments, combine_moments, kurtosis
from tests.stats_models import MODELS, VOCAB, build, embedding, loss_of

MASSIVE_TOKEN = 3


def _first_tensor(v):
    if isinstance(v, torch.Tensor):
        return v
    return v[0] if isinstance(v, (tuple, list)) and v and isinstance(v[0], torch.Tensor) else None


def _site_tensors(model, idx, sites) -> dict[str, torch.Tensor]:
    """The tensor crossing each site in one forward of ``model`` (its own hooks)."""
    modules, seen = dict(model.named_modules()), {}

    def hook(name):
        def f(module, args, kwargs, output):
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if x is None:
                x = next((v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
            seen.setdefault(f"{name}.in", x.detach().double())
            seen.setdefault(f"{name}.out", _first_tensor(output).detach().double())
        return f

    names = {s.rsplit(".", 1)[0] for s in sites}
    handles = [modules[n].register_forward_hook(hook(n), with_kwargs=True) for n in names]
    with torch.no_grad():
        loss_of(model, idx)
    for h in handles:
        h.remove()
    return {s: seen[s] for s in sites}


def _kurtosis(x: torch.Tensor) -> float:
    d = x.flatten() - x.mean()
    return float((d ** 4).mean() / (d ** 2).mean() ** 2)


def _massive(x: torch.Tensor) -> int:
    a = x.abs().flatten()
    median = a.sort().values[(a.numel() - 1) // 2]
    return int(((a > 100) & (a > 1000 * median)).sum())


def _reference(twin, batches, sites) -> pd.DataFrame:
    per = [_site_tensors(twin, idx, sites) for idx in batches]
    rows = []
    for s in sites:
        for m, t in enumerate(per):
            rows += [dict(micro_step=m, site=s, quantity="act_abs_max", value=float(t[s].abs().max())),
                     dict(micro_step=m, site=s, quantity="act_kurtosis", value=_kurtosis(t[s])),
                     dict(micro_step=m, site=s, quantity="massive_act_count", value=float(_massive(t[s])))]
        joined = torch.cat([t[s].flatten() for t in per])
        rows += [dict(micro_step=-1, site=s, quantity="act_abs_max", value=float(joined.abs().max())),
                 dict(micro_step=-1, site=s, quantity="act_kurtosis", value=_kurtosis(joined)),
                 dict(micro_step=-1, site=s, quantity="massive_act_count",
                      value=float(sum(_massive(t[s]) for t in per)))]
    return pd.DataFrame(rows)


def _model_with_massive_activations(kind: str, layers: int):
    torch.manual_seed(0)
    model = build(kind, layers)
    with torch.no_grad():
        embedding(model).weight[MASSIVE_TOKEN, 0] = 5000.0
    return model


CASES = [(k, False) for k in MODELS] + [(k, True) for k in ("nanogpt", "encoder", "gpt2")]


@pytest.mark.parametrize("kind,compiled", CASES, ids=[f"{k}-{'compiled' if c else 'eager'}" for k, c in CASES])
def test_outlier_statistics_match_the_tensors(kind, compiled):
    model = _model_with_massive_activations(kind, layers=1 if compiled else 2)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 6), generator=g) for _ in range(2)]
    batches[0][0, 2] = MASSIVE_TOKEN
    # compiled: the three and act_grad_norm, whose gradient taps tell a compiled run's micro-steps apart (the
    # "outliers" set's other default quantities would add minutes of compiling and nothing to check here)
    outliers = ["act_grad_norm", "act_abs_max", "act_kurtosis", "massive_act_count"]
    rec = gradscope.Recorder(model, quantities=outliers if compiled else "outliers")
    run = torch.compile(model, fullgraph=True) if compiled else model
    with rec.step(0):
        for idx in batches:
            loss_of(run, idx).backward()
    rec.close()
    df = rec.frame(micro_steps=True)
    sites = gradscope.site_names(twin)
    ref = _reference(twin, batches, sites).set_index(["quantity", "micro_step", "site"]).value
    # eager: the same tensors, fp32 reductions against float64 ones; compiled: Inductor's fusions
    tol = 2e-5 if compiled else 1e-5
    for quantity in ("act_abs_max", "act_kurtosis", "massive_act_count"):
        got = df[df.quantity == quantity].set_index(["micro_step", "site"]).value
        assert set(got.index) == {(m, s) for m in (-1, 0, 1) for s in sites}, f"{quantity}: rows missing"
        expect = ref[quantity][got.index]
        if quantity == "massive_act_count":
            assert (got == expect.values).all(), f"{quantity}: {got[got != expect.values]}"
        else:
            rel = np.abs(got.values - expect.values) / np.abs(expect.values)
            assert rel.max() <= tol, f"{quantity}: {rel.max():.2e} at {got.index[rel.argmax()]}"
    # the planted activation is massive where it survives (before any norm), so the count can fail
    assert ref["massive_act_count"].max() >= 1


def test_moments_combine_exactly():
    g = np.random.default_rng(0)
    parts = [g.normal(3.0, 2.0, 50) ** 3, g.normal(-1.0, 0.5, 7), np.array([40.0])]
    moments = [Moments(*(np.array(v) for v in (len(p), p.mean(), ((p - p.mean()) ** 2).sum(),
                                                 ((p - p.mean()) ** 3).sum(), ((p - p.mean()) ** 4).sum())))
               for p in parts]
    total = combine_moments(combine_moments(moments[0], moments[1]), moments[2])
    whole = np.concatenate(parts)
    d = whole - whole.mean()
    assert float(kurtosis(total)) == pytest.approx(float((d ** 4).mean() / (d ** 2).mean() ** 2), rel=1e-12)
    empty = Moments(*(np.zeros(()) for _ in range(5)))
    assert float(kurtosis(combine_moments(empty, moments[0]))) == pytest.approx(float(kurtosis(moments[0])), rel=1e-12)


def test_the_default_set_takes_no_outlier_statistic():
    model = build("nanogpt")
    rec = gradscope.Recorder(model)
    with rec.step(0):
        loss_of(model, torch.randint(0, VOCAB, (2, 6))).backward()
    rec.close()
    assert not {"act_abs_max", "act_kurtosis", "massive_act_count"} & set(rec.frame().quantity)


def test_a_site_value_of_several_numbers_needs_its_own_rows_and_the_right_size():
    class TwoNumbers(gradscope.Quantity):
        name, site_value_size = "act_two_numbers", 2

        def site_value(self, h):
            return torch.stack([h.amax(), h.amin()])

    class Wrong(TwoNumbers):
        def rows(self, data):
            return []

        def site_value(self, h):
            return h.amax()

    model = build("nanogpt")
    with pytest.raises(ValueError, match="TwoNumbers.site_value_size is 2"):
        gradscope.Recorder(model, quantities=[TwoNumbers()])
    rec = gradscope.Recorder(model, quantities=[Wrong()])
    with pytest.raises(TypeError, match=r"Wrong.site_value at site .*: must return a tensor of 2 numbers"):
        with rec.step(0):
            loss_of(model, torch.randint(0, VOCAB, (2, 6))).backward()
    rec.close()
