"""``python -m gradscope scan``: one forward/backward on a synthetic batch, and a verdict.

The scan answers "will this stack have trouble?" before any training: the per-layer
gradient norm of every layer output, the smallest LayerNorm gain (Takase 2022 §3), and any
non-finite site. Models: a zoo variant, a HuggingFace architecture built from its config
class with random weights (nothing is downloaded), or one's own (``--model pkg.module:factory``,
:mod:`gradscope.model_spec`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

import gradscope

DECAY_VANISHING = 0.1  # bottom/top gradient ratio below this: vanishing toward the bottom
DECAY_EXPLODING = 10.0  # above this: growing toward the bottom
ATTN_LOGIT_LARGE = 50.0  # a max attention logit above this: softmax is one-hot to e^-50 (Wortsman 2023 §3.1)
GRAD_RMS_OVER_EPS_LOW = 10.0  # gradient RMS below 10·ε: Adam's update shrinks (Wortsman 2023 §3.4)
HF_ARCHS = ("gpt2", "bert", "t5", "llama")


@dataclass(frozen=True)
class ScanResult:
    """What a scan found.

    Attributes:
        table: the tidy table of the step.
        layers: per-layer summary (stack, layer, act_grad_norm at the layer output,
            smallest ln_gain inside the layer).
        decay: stack → act_grad_norm(first layer output) / act_grad_norm(last layer output).
        smallest_gain: (norm name, value) of the smallest ln_gain, or None.
        nonfinite: sites where a NaN/Inf appeared, in order (forward first).
        attn_logit_max: (attention module, value) of the largest attention logit, or None.
        low_grad_rms: parameter groups whose gradient RMS is below ``GRAD_RMS_OVER_EPS_LOW``·ε.
    """

    table: pd.DataFrame
    layers: pd.DataFrame
    decay: dict[str, float]
    smallest_gain: tuple[str, float] | None
    nonfinite: list[str]
    attn_logit_max: tuple[str, float] | None = None
    low_grad_rms: tuple[str, ...] = ()

    def verdicts(self) -> list[str]:
        """One line per finding."""
        lines = []
        for stack, ratio in self.decay.items():
            kind = ("vanishing toward the bottom" if ratio < DECAY_VANISHING else
                    "growing toward the bottom" if ratio > DECAY_EXPLODING else "within 10x top to bottom")
            lines.append(f"{stack or 'blocks'}: gradient norm bottom/top layer = {ratio:.3g} "
                         f"({kind}; thresholds {DECAY_VANISHING}, {DECAY_EXPLODING})")
        if self.smallest_gain:
            lines.append(f"smallest LN gain ‖grad in‖/‖grad out‖ = {self.smallest_gain[1]:.3g} at {self.smallest_gain[0]}")
        lines.append("non-finite sites: " + (", ".join(self.nonfinite[:5]) if self.nonfinite else "none"))
        if self.attn_logit_max:
            site, value = self.attn_logit_max
            warn = f" — WARNING: above {ATTN_LOGIT_LARGE:g}, attention is near one-hot (logit growth)" \
                if value > ATTN_LOGIT_LARGE else ""
            lines.append(f"largest attention logit = {value:.3g} at {site}{warn}")
        if self.low_grad_rms:
            lines.append(f"WARNING: gradient RMS below {GRAD_RMS_OVER_EPS_LOW:g}·Adam's ε in {len(self.low_grad_rms)} "
                         f"parameter group(s): {', '.join(self.low_grad_rms[:4])} (updates shrink toward 0)")
        return lines

    @property
    def healthy(self) -> bool:
        """No non-finite value and every stack's decay within the thresholds."""
        return (not self.nonfinite and all(DECAY_VANISHING <= r <= DECAY_EXPLODING for r in self.decay.values())
                and not (self.attn_logit_max and self.attn_logit_max[1] > ATTN_LOGIT_LARGE) and not self.low_grad_rms)


def summarize(table: pd.DataFrame) -> ScanResult:
    """Builds the per-layer summary and verdict from one step's tidy table."""
    acc = table[table.micro_step == -1]
    outs = acc[(acc.quantity == "act_grad_norm") & (acc.role == "layer_out")]  # zoo and foreign blocks alike
    layers = outs[["stack", "layer", "site", "value"]].rename(columns={"value": "act_grad_norm"})
    gains = acc[acc.quantity == "ln_gain"]
    min_gain = gains.groupby(["stack", "layer"], dropna=False).value.min().rename("min_ln_gain").reset_index()
    layers = layers.merge(min_gain, on=["stack", "layer"], how="left").sort_values(["stack", "layer"]).reset_index(drop=True)
    decay = {}
    for stack, rows in layers.groupby("stack", sort=False):
        rows = rows.sort_values("layer")
        top = rows.act_grad_norm.iloc[-1]
        decay[stack] = rows.act_grad_norm.iloc[0] / top if top > 0 else math.inf
    smallest = None
    finite_gains = gains[gains.value.apply(math.isfinite)]
    if len(finite_gains):
        row = finite_gains.loc[finite_gains.value.idxmin()]
        smallest = (row.site, float(row.value))
    bad = table[table.quantity.isin(["nonfinite", "nonfinite_grad"])].sort_values(["quantity", "value"], ascending=[True, True])
    logits = acc[(acc.quantity == "attn_logit_max") & acc.layer_j.isna()]
    top = None if logits.empty else logits.loc[logits.value.idxmax()]
    rms = acc[(acc.quantity == "grad_rms_over_eps") & (acc.value < GRAD_RMS_OVER_EPS_LOW)]
    return ScanResult(table, layers, decay, smallest, bad.site.tolist(),
                      None if top is None else (top.site, float(top.value)), tuple(rms.site.tolist()))


def zoo_model(args) -> tuple[torch.nn.Module, tuple, callable]:
    """A zoo model, a synthetic batch and its loss function from scan arguments, on ``args.device``."""
    config = gradscope.presets.small(arch=args.arch, variant=args.variant, init=args.init, n_enc=args.n_enc,
                                     n_dec=args.n_dec, d_model=args.d_model, n_heads=args.n_heads, d_ff=args.d_ff,
                                     vocab=args.vocab, dropout=0.0, max_len=max(args.length + 1, 8))
    model = gradscope.build_model(config)
    g = torch.Generator().manual_seed(args.seed)
    src = torch.randint(3, args.vocab, (args.batch_size, args.length), generator=g)
    tgt = torch.randint(3, args.vocab, (args.batch_size, args.length + 1), generator=g)
    inputs = (src, tgt[:, :-1]) if args.arch == "encoder_decoder" else (src,)
    target = tgt[:, 1:] if args.arch == "encoder_decoder" else torch.roll(src, -1, dims=1)
    model.to(args.device)
    inputs, target = tuple(t.to(args.device) for t in inputs), target.to(args.device)
    if args.variant == "admin":
        gradscope.admin_init(model, *inputs)

    def loss_fn(logits):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)

    return model, inputs, loss_fn


def hf_model(args) -> tuple[torch.nn.Module, dict]:
    """A HuggingFace model built from its config class (random weights), a batch and a loss."""
    try:
        import transformers
    except ImportError as err:
        raise SystemExit("scan --hf needs transformers: pip install 'gradscope[hf]'") from err
    n, d, heads, vocab = args.n_layer, args.d_model, args.n_heads, args.vocab
    builders = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=n, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=max(64, args.length), bos_token_id=0, eos_token_id=0)),
        "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=n, hidden_size=d, num_attention_heads=heads, intermediate_size=4 * d, vocab_size=vocab,
            max_position_embeddings=max(64, args.length))),
        "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
            num_layers=n, num_decoder_layers=n, d_model=d, d_ff=4 * d, d_kv=d // heads, num_heads=heads, vocab_size=vocab,
            decoder_start_token_id=0, pad_token_id=0)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=n, hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=4 * d,
            vocab_size=vocab, max_position_embeddings=max(64, args.length), bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    }
    model = builders[args.hf]().to(args.device).train()
    ids = torch.randint(1, vocab, (args.batch_size, args.length), generator=torch.Generator().manual_seed(args.seed))
    return model, {"input_ids": ids.to(args.device), "labels": ids.to(args.device)}


@dataclass
class OwnModel:
    """A ``--model`` model with its synthetic batch and loss; ``loss_text`` says which loss
    was taken, once the loss has seen the output."""

    model: torch.nn.Module
    inputs: tuple
    loss_fn: Callable
    loss_text: str = ""


def _output_tensor(out) -> torch.Tensor:
    """The tensor a model's output holds: itself, ``.logits``, ``.last_hidden_state``, or a
    tuple's, list's or dict's first tensor."""
    for name in ("logits", "last_hidden_state"):
        if isinstance(getattr(out, name, None), torch.Tensor):
            return getattr(out, name)
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor)), out)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model's output is a {type(out).__name__} holding no tensor; the scan needs a tensor "
                        "(or .logits, or a tuple whose first tensor is the output)")
    return out


def own_model(args) -> OwnModel:
    """``--model``'s model (:func:`gradscope.model_spec.load_model`) on ``args.device``, a
    synthetic batch (``--input tokens``: ids in [1, vocab) of shape (batch, length);
    ``float``: N(0, 1) of shape (batch, length, d_model)) and its loss: next-token
    cross-entropy when the output is (batch, length, V) logits of token input, else the mean
    of the output's squares (said in ``loss_text``)."""
    from gradscope.model_spec import load_model

    model = load_model(args.model).to(args.device).train()
    g = torch.Generator().manual_seed(args.seed)
    if args.input == "tokens":
        x = torch.randint(1, args.vocab, (args.batch_size, args.length), generator=g)
    else:
        x = torch.randn(args.batch_size, args.length, args.d_model, generator=g)
    own = OwnModel(model, (x.to(args.device),), None)

    def loss_fn(output):
        y = _output_tensor(output).float()
        if args.input == "tokens" and y.dim() == 3 and tuple(y.shape[:2]) == tuple(x.shape):
            own.loss_text = "next-token cross-entropy of the (batch, length, vocab) output"
            return F.cross_entropy(y[:, :-1].flatten(0, 1), own.inputs[0][:, 1:].flatten())
        own.loss_text = f"mean of the squares of the output {tuple(y.shape)} (no token logits: a synthetic loss)"
        return y.square().mean()

    own.loss_fn = loss_fn
    return own


def scan_own(args) -> tuple[ScanResult, str]:
    """Scans ``--model``'s model: (the result, the loss taken, in words).

    Raises:
        ValueError: the spec gives no model (:class:`gradscope.model_spec.ModelSpecError`),
            or the model fails on the synthetic batch (naming the batch and the flags that set it).
    """
    torch.manual_seed(args.seed)
    own = own_model(args)
    x = own.inputs[0]
    try:
        table = gradscope.snapshot(own.model, own.inputs, own.loss_fn, quantities="signals", run="scan",
                                   optimizer=_eps_only(own.model))
    except Exception as err:
        batch = f"ids in [1, {args.vocab})" if args.input == "tokens" else "N(0, 1) values"
        raise ValueError(f"--model {args.model!r}: the model on --input {args.input} of shape {tuple(x.shape)} ({batch}) "
                         f"failed: {type(err).__name__}: {err} (set --input, --vocab, --d-model and --length to what "
                         "the model takes)") from err
    return summarize(table), own.loss_text


def run_scan(args) -> ScanResult:
    """Builds the model the arguments describe, records one step, and summarises it."""
    torch.manual_seed(args.seed)
    if getattr(args, "model", None):
        return scan_own(args)[0]
    if args.hf:
        model, kwargs = hf_model(args)
        with gradscope.record(model, quantities="signals", run="scan", optimizer=_eps_only(model)) as rec:
            loss = model(**kwargs).loss
            loss.backward()
            rec.log("loss", loss)
        return summarize(rec.frame())
    model, inputs, loss_fn = zoo_model(args)
    return summarize(gradscope.snapshot(model, inputs, loss_fn, quantities="signals", run="scan", optimizer=_eps_only(model)))


def _eps_only(model: torch.nn.Module) -> torch.optim.Optimizer:
    """An Adam that never steps, so the scan can compare gradient RMS with the usual ε = 1e-8."""
    return torch.optim.Adam(model.parameters(), eps=1e-8)
