"""The model, the batch and the timed methods of :mod:`benchmarks.overhead`.

Each method is set up on its own copy of the model and optimizer and returns a
:class:`Runner` whose ``step(i)`` is one full training step (forward, backward, optimizer).
With ``compiled=True`` the model copy is compiled once, with ``torch.compile(fullgraph=True)``,
after any recorder hooks are installed (``torch.compile`` sees only hooks that exist when it
traces); whatever a method does besides the model call (``.item()`` loops, Lightning's
``grad_norm``) stays eager, as it would in a user's loop.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F

import gradscope
from gradscope.recorder.numerics.squared_norms import fp64_squared_norms, squared_norm, squared_norms

BETAS = (0.9, 0.98)


class EagerOnly(Exception):
    """Raised by a method's setup when it has no compiled form; the message says why."""


@dataclass
class Runner:
    """One method on its own model copy.

    Attributes:
        step: runs training step ``i`` (forward, backward, optimizer step).
        recorder: the gradscope Recorder attached, if any (its table is checked).
        finish: called once after timing (closes hooks, finishes runs).
    """

    step: Callable[[int], None]
    recorder: gradscope.Recorder | None = None
    finish: Callable[[], None] = field(default=lambda: None)

    def frame(self) -> pd.DataFrame | None:
        """The recorder's table, or None when no recorder is attached."""
        return None if self.recorder is None else self.recorder.frame()


@dataclass
class Method:
    """A timed method.

    Attributes:
        name: the table's row label.
        setup: ``setup(model, optimizer, batch, compiled) -> Runner``.
        records: whether its timed steps must leave rows in a table (the run is invalid
            otherwise).
    """

    name: str
    setup: Callable[..., Runner]
    records: bool = False


def make_model(total_layers: int, d_model: int, device: str) -> torch.nn.Module:
    """A Pre-LN encoder–decoder with ``total_layers / 2`` layers per stack (12 = the 6+6 reference).

    Args:
        total_layers: encoder plus decoder layers, split evenly.
        d_model: model width (4 heads, ``d_ff = 4 * d_model``).
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        The model, seeded so every call gives the same weights.
    """
    torch.manual_seed(0)
    config = gradscope.ModelConfig(variant="pre_ln", n_enc=total_layers // 2, n_dec=total_layers // 2, d_model=d_model,
                                   n_heads=4, d_ff=4 * d_model, vocab=1000, dropout=0.1, max_len=64)
    return gradscope.build_model(config).to(device)


def make_batch(batch_size: int, length: int, device: str) -> tuple[torch.Tensor, ...]:
    """A fixed random batch ``(src, tgt_in, tgt_out)`` of token ids."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, 1000, (batch_size, length), generator=g)
    tgt = torch.randint(3, 1000, (batch_size, length + 1), generator=g)
    return src.to(device), tgt[:, :-1].to(device), tgt[:, 1:].to(device)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer every copy gets: Adam, lr 1e-4, betas (0.9, 0.98)."""
    return torch.optim.Adam(model.parameters(), 1e-4, betas=BETAS)


def loss_of(run: Callable, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Label-smoothed cross-entropy of ``run(src, tgt_in)`` (``run``: the model or its compiled form)."""
    src, tgt_in, tgt_out = batch
    logits = run(src, tgt_in)
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), label_smoothing=0.1)


def maybe_compile(model: torch.nn.Module, compiled: bool) -> Callable:
    """``torch.compile(model, fullgraph=True)`` when ``compiled``, else the model itself."""
    return torch.compile(model, fullgraph=True) if compiled else model


def _finish_opt(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)


def plain(model, opt, batch, compiled: bool) -> Runner:
    """A plain training step; its model copy never has a recorder attached."""
    run = maybe_compile(model, compiled)

    def step(i):
        loss_of(run, batch).backward()
        _finish_opt(opt)
    return Runner(step)


def with_recorder(quantities: str | list[str], every: int = 1, sinks: Callable[[], list] = list) -> Callable[..., Runner]:
    """Setup of a gradscope Recorder (``slow_every=10``), made before the model is compiled.

    Args:
        quantities: ``"default"``, ``"all"`` or a list of quantity names.
        every: record steps that are multiples of this (``1000``: the timed steps are not
            recorded, which times the hooks' pass-through).
        sinks: makes the Recorder's extra sinks (called at setup).
    """
    def setup(model, opt, batch, compiled: bool) -> Runner:
        rec = gradscope.Recorder(model, quantities=quantities, every=every, optimizer=opt, slow_every=10, sinks=sinks())
        run = maybe_compile(model, compiled)

        def step(i):
            with rec.step(i):
                loss = loss_of(run, batch)
                loss.backward()
                rec.log("loss", loss)
            _finish_opt(opt)
        return Runner(step, recorder=rec, finish=rec.close)
    return setup


def naive_item(model, opt, batch, compiled: bool) -> Runner:
    """``p.grad.norm().item()`` for every parameter after backward (eager loop)."""
    run = maybe_compile(model, compiled)

    def step(i):
        loss_of(run, batch).backward()
        _ = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
        _finish_opt(opt)
    return Runner(step)


def bare_site_norms(with_params: bool = False) -> Callable[..., Runner]:
    """The floor: a forward hook per distinct site value and a tensor hook per gradient, each
    taking one squared norm (:func:`gradscope.recorder.numerics.squared_norms.squared_norm`, the recorder's
    own reduction) into a list, with no bookkeeping at all: what any recorder of these
    quantities has to do. ``with_params``: also the squared norm of every parameter gradient
    (:func:`~gradscope.recorder.numerics.squared_norms.squared_norms`), so the reductions are those of
    gradscope's default quantities. Eager only: its hooks are added and removed every step."""

    def setup(model, opt, batch, compiled: bool) -> Runner:
        if compiled:
            raise EagerOnly("eager only (hooks added per step)")
        sites = [m for m in model.modules() if isinstance(m, gradscope.Site)]
        params = list(model.parameters())

        def step(i):
            out: list[torch.Tensor] = []
            # the values seen, held until the step ends: a freed tensor's id is reused by the
            # next one made, which a set of ids alone would take for a value seen before (it
            # skipped about a third of the site values and their gradients of the 6+6 model)
            seen: dict[int, torch.Tensor] = {}

            def on_value(module, args, value):
                if id(value) not in seen:
                    seen[id(value)] = value
                    out.append(squared_norm(value))
                    value.register_hook(lambda g: out.append(squared_norm(g)))

            handles = [m.register_forward_hook(on_value) for m in sites]
            loss_of(model, batch).backward()
            for h in handles:
                h.remove()
            if with_params:
                out.append(squared_norms([p.grad for p in params if p.grad is not None]).sum())
            torch.stack(out).tolist()
            _finish_opt(opt)
        return Runner(step)
    return setup


def simple_site_hooks(own_gradients: bool = False) -> Callable[..., Runner]:
    """A simple reference recorder built on module hooks, with gradscope's own reduction: what
    a recorder of the default quantities has to do, without books (not a proven lower bound:
    reviews found cheaper designs, ``benchmarks/RESULTS.md``).

    One forward pre-hook per site, registered once (a :class:`gradscope.Site` is the
    identity, so its input is its value), notes which tensor each site call received and
    keeps that tensor's gradient by ``retain_grad`` (a C++ hook: no Python in backward).
    After backward, under ``no_grad``: the fp64 squared norms of the values, of their
    gradients and of the parameters' gradients (:func:`~gradscope.recorder.numerics.squared_norms.fp64_squared_norms`:
    one stack or a few concatenations each, no reduction per tensor), and one host transfer.
    No books (no micro-steps, checks or rows), no arming, no norm fits.

    Args:
        own_gradients: every site call passes on an alias of its value (``x[...]``, as the
            recorder does) and keeps the alias's gradient, so each site has its own: the
            gradient of what follows the site (two sites that receive one tensor get the
            uses after each), and at a norm's input the gradient through that norm alone.
            Without it, sites that receive one tensor share its whole gradient (fewer
            tensors, not gradscope's quantity at a norm's input).
    """

    def setup(model, opt, batch, compiled: bool) -> Runner:
        if compiled:
            raise EagerOnly("eager only (a module hook per site)")
        sites = [m for m in model.modules() if isinstance(m, gradscope.Site)]
        params = list(model.parameters())
        kept: dict[int, torch.Tensor] = {}  # the tensors whose gradients are kept, by id (held: no id is reused)
        received: list[int] = []  # per site call, the id of its tensor: the per-site rows a recorder writes

        def on_input(module, args):
            x = args[0]
            if own_gradients:
                x = x[...]
            if id(x) not in kept:
                kept[id(x)] = x
                if x.requires_grad:
                    x.retain_grad()
            received.append(id(x))
            return (x,) if own_gradients else None

        for m in sites:  # (left on the benchmark's own copy of the model, which is dropped after timing)
            m.register_forward_pre_hook(on_input)

        def step(i):
            kept.clear()
            received.clear()
            loss_of(model, batch).backward()
            with torch.no_grad():
                values = list(kept.values())
                grads = [v.grad for v in values if v.grad is not None]
                norms = [fp64_squared_norms(values), fp64_squared_norms([p.grad for p in params if p.grad is not None])]
                if grads:
                    norms.append(fp64_squared_norms(grads))
                torch.cat(norms).tolist()
            _finish_opt(opt)
        return Runner(step)
    return setup


def simple_param_norms(model, opt, batch, compiled: bool) -> Runner:
    """A simple reference for the parameter-gradient norms of any tool, eager or compiled: the
    ``p.grad`` of a parameter list taken once (no check that the model still holds those
    parameters), their fp64 squared norms by gradscope's own grouped reduction (a
    concatenation per trailing shape: on a CPU, ``_foreach_norm`` reduces tensor by tensor
    and costs more) and one host transfer; no groups, no rows."""
    run = maybe_compile(model, compiled)
    params = list(model.parameters())

    def step(i):
        loss_of(run, batch).backward()
        with torch.no_grad():
            fp64_squared_norms([p.grad for p in params if p.grad is not None]).tolist()
        _finish_opt(opt)
    return Runner(step)


def wandb_watch(model, opt, batch, compiled: bool) -> Runner:
    """``wandb.watch(model, log="gradients", log_freq=1)`` in an offline run."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run_ = wandb.init(mode="offline", dir=tempfile.mkdtemp(prefix="gradscope-wandb-"), project="gradscope-bench")
    run_.watch(model, log="gradients", log_freq=1)
    run = maybe_compile(model, compiled)

    def step(i):
        loss = loss_of(run, batch)
        loss.backward()
        run_.log({"loss": loss.item()})
        _finish_opt(opt)
    return Runner(step, finish=run_.finish)


def gradscope_wandb(model, opt, batch, compiled: bool) -> Runner:
    """gradscope (default quantities) streaming every recorded step to an offline W&B run
    through :class:`gradscope.sinks.WandbSink`: one ``wandb.log`` per step, as ``wandb_watch``."""
    import wandb

    from gradscope.sinks import WandbSink

    os.environ.setdefault("WANDB_SILENT", "true")
    run_ = wandb.init(mode="offline", dir=tempfile.mkdtemp(prefix="gradscope-wandb-"), project="gradscope-bench")
    runner = with_recorder("default", sinks=lambda: [WandbSink(run=run_)])(model, opt, batch, compiled)

    def finish():
        runner.finish()
        run_.finish()
    return Runner(runner.step, recorder=runner.recorder, finish=finish)


def lightning_grad_norm(model, opt, batch, compiled: bool) -> Runner:
    """Lightning's ``grad_norm`` utility, read to floats as ``self.log_dict`` would."""
    from lightning.pytorch.utilities import grad_norm

    run = maybe_compile(model, compiled)

    def step(i):
        loss_of(run, batch).backward()
        _ = {k: float(v) for k, v in grad_norm(model, norm_type=2).items()}
        _finish_opt(opt)
    return Runner(step)


METHODS: list[Method] = [
    Method("plain, a second copy (the timing's own noise)", plain),  # A/A: two copies' noise and placement
    Method("gradscope norms (default)", with_recorder("default"), records=True),
    Method("gradscope all (cosine every 10)", with_recorder("all"), records=True),
    Method("gradscope signals (default + attention logits/entropy, log Z, RMS, grad RMS/eps)", with_recorder("signals"),
           records=True),
    Method("gradscope signals, every 10th step recorded (every=10)", with_recorder("signals", every=10), records=True),
    Method("gradscope attached, step not recorded (every=1000)", with_recorder("default", every=1000)),
    Method("bare hooks: one squared norm per site value and gradient", bare_site_norms()),
    Method("bare hooks + parameter-gradient norms (the default quantities' reductions, no bookkeeping)",
           bare_site_norms(with_params=True)),
    Method("simple site hooks: a hook per site keeping value and gradient (sites share a tensor's), "
           "parameter norms, one transfer", simple_site_hooks()),
    Method("simple site hooks, each site's own gradient (an alias per site, as gradscope)", simple_site_hooks(True)),
    Method("simple parameter norms: p.grad of a fixed list, their squared norms, one transfer", simple_param_norms),
    Method("naive p.grad.norm().item() loop", naive_item),
    Method("gradscope default -> W&B sink (WandbSink) offline", gradscope_wandb, records=True),
    Method("wandb.watch(log='gradients', log_freq=1) offline", wandb_watch),
    Method("lightning grad_norm", lightning_grad_norm),
]

BREAKDOWN = ("act_grad_norm", "act_norm", "param_grad_norm", "ln_gain", "ln_w_over_sigma", "nonfinite")


def set_methods(sets: list[str]) -> list[Method]:
    """gradscope with each named preset (``--sets outliers weights``: issue 52's opt-in sets) or
    comma-separated list of quantity names (``act_abs_max,act_kurtosis``)."""
    return [Method(f"gradscope {name} (quantities={name!r})", with_recorder(name if "," not in name else name.split(",")),
                   records=True) for name in sets]


def breakdown_methods() -> list[Method]:
    """gradscope with one quantity at a time (where the cost is; rows share fixed costs)."""
    return [Method(f"gradscope {q} only", with_recorder([q]), records=True) for q in BREAKDOWN]
