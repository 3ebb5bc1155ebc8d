"""The recorder on published architectures, built tiny with random weights (nothing downloaded):
a nanoGPT written here, x-transformers, HuggingFace models from their config classes and
``torch.nn.Transformer``.

Expected sites come from the foreign-model rules, derived here from ``named_modules()``:

- repeated blocks: an ``nn.ModuleList``/``nn.Sequential`` at path P whose >= 2 children are all
  of one class and hold parameters (not inside another such list); sites ``P.i.in`` / ``P.i.out``.
  When the children are containers (x-transformers' ``ModuleList([norms, block, residual])``)
  the block is the non-container child holding parameters (``P.i.1``).
- norms: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, batch norms, or a leaf module whose
  class name ends in ``Norm`` with only <= 1-D parameters; parametrizations (weight norm's
  ``_WeightNorm``) are not activation norms. Sites ``N.in`` (gradient through the norm alone)
  and ``N.out`` (total gradient).
- the k-th call (k >= 2) of a module in one forward gets ``#k`` appended.

References are plain autograd on tensors captured by hooks written here; parameter norms come
from ``torch.autograd.grad`` w.r.t. the parameters.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope
from recorder_ref import _first, all_hook_dicts_empty, assert_rel, norm_gains

transformers = pytest.importorskip("transformers")
x_transformers = pytest.importorskip("x_transformers")

V, D, T, B = 60, 32, 8, 2
VALUE_QUANTITIES = ["act_grad_norm", "act_norm", "param_grad_norm", "ln_gain", "ln_w_over_sigma"]


def _ids(shape=(B, T), seed=0, low=0):
    return torch.randint(low, V, shape, generator=torch.Generator().manual_seed(seed))


# -- nanoGPT (Karpathy's model.py, trimmed) ----------------------------------------------------
class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm: optional bias, F.layer_norm; eps is a literal, not an attribute."""

    def __init__(self, ndim, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head, p):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.resid_dropout = nn.Dropout(p)
        self.n_head, self.n_embd, self.dropout = n_head, d, p

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj, self.dropout = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d, n_head, p):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = LayerNorm(d), CausalSelfAttention(d, n_head, p), LayerNorm(d), MLP(d, p)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, p, n_layer=2, n_head=2, block_size=16):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, D), wpe=nn.Embedding(block_size, D), drop=nn.Dropout(p),
            h=nn.ModuleList([Block(D, n_head, p) for _ in range(n_layer)]), ln_f=LayerNorm(D)))
        self.lm_head = nn.Linear(D, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx, targets):
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1])))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


# -- builders: build(p) -> (model, run), run() returns the loss ------------------------------
def nanogpt(p):
    model, ids = GPT(p), _ids()
    return model, lambda: model(ids, ids)


def _xt(p, encoder):
    cls = x_transformers.Encoder if encoder else x_transformers.Decoder
    extra = {"use_rmsnorm": True} if encoder else {}
    model = x_transformers.TransformerWrapper(
        num_tokens=V, max_seq_len=16, emb_dropout=p,
        attn_layers=cls(dim=D, depth=2, heads=2, attn_dropout=p, ff_dropout=p, **extra))
    ids = _ids()
    return model, lambda: F.cross_entropy(model(ids).reshape(-1, V), ids.reshape(-1))


def _hf_causal(model_cls, config_cls, **extra):
    def build(p):
        cfg = config_cls(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=32, attention_dropout=p,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, **extra)
        model, ids = model_cls(cfg), _ids()
        return model, lambda: model(input_ids=ids, labels=ids).loss
    return build


def gpt_neox(p):
    cfg = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2, max_position_embeddings=32, hidden_dropout=p,
                                     attention_dropout=p, bos_token_id=0, eos_token_id=0)
    model, ids = transformers.GPTNeoXForCausalLM(cfg), _ids()
    return model, lambda: model(input_ids=ids, labels=ids).loss


def gpt2(p):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, vocab_size=V, n_positions=32, resid_pdrop=p,
                                  embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0)
    model, ids = transformers.GPT2LMHeadModel(cfg), _ids()
    return model, lambda: model(input_ids=ids, labels=ids).loss


def bert(p):
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=D, num_attention_heads=2, intermediate_size=48,
                                  vocab_size=V, max_position_embeddings=32, hidden_dropout_prob=p,
                                  attention_probs_dropout_prob=p)
    model, ids = transformers.BertForMaskedLM(cfg), _ids()
    return model, lambda: model(input_ids=ids, labels=ids).loss


def albert(p):
    cfg = transformers.AlbertConfig(num_hidden_layers=2, hidden_size=D, embedding_size=16, num_attention_heads=2,
                                    intermediate_size=48, vocab_size=V, max_position_embeddings=32,
                                    hidden_dropout_prob=p, attention_probs_dropout_prob=p, classifier_dropout_prob=p)
    model, ids = transformers.AlbertForMaskedLM(cfg), _ids()
    return model, lambda: model(input_ids=ids, labels=ids).loss


def t5(p):
    cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=D, d_ff=48, d_kv=16, num_heads=2,
                                vocab_size=V, dropout_rate=p, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    src, tgt = _ids(seed=1, low=1), _ids((B, 5), seed=2, low=1)
    return model, lambda: model(input_ids=src, labels=tgt).loss


def vit(p):
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=48, hidden_dropout_prob=p,
                                 attention_probs_dropout_prob=p, num_labels=3)
    model = transformers.ViTForImageClassification(cfg)
    x, y = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 2])
    return model, lambda: model(pixel_values=x, labels=y).loss


def _wav2vec2(stable):
    def build(p):
        cfg = transformers.Wav2Vec2Config(
            vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2, do_stable_layer_norm=stable, feat_extract_norm="layer" if stable else "group",
            hidden_dropout=p, attention_dropout=p, activation_dropout=p, feat_proj_dropout=p, final_dropout=p,
            layerdrop=4 * p, mask_time_prob=0.0, mask_feature_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0)
        model = transformers.Wav2Vec2ForCTC(cfg)
        g = torch.Generator().manual_seed(0)
        x, labels = torch.randn(B, 400, generator=g), torch.randint(1, V, (B, 4), generator=g)
        return model, lambda: model(input_values=x, labels=labels).loss
    return build


def patchtst(p):
    cfg = transformers.PatchTSTConfig(num_input_channels=2, context_length=32, patch_length=8, patch_stride=8,
                                      prediction_length=4, d_model=D, num_hidden_layers=2, num_attention_heads=2,
                                      ffn_dim=48, dropout=p, attention_dropout=p, ff_dropout=p, path_dropout=p,
                                      head_dropout=p, positional_dropout=p)
    model = transformers.PatchTSTForPrediction(cfg)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, 32, 2, generator=g), torch.randn(B, 4, 2, generator=g)
    return model, lambda: model(past_values=x, future_values=y).loss


def torch_transformer(p):
    model = nn.Transformer(d_model=D, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=48,
                           dropout=p, batch_first=True)
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randn(B, T, D, generator=g), torch.randn(B, 5, D, generator=g)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    return model, lambda: model(src, tgt, tgt_mask=mask, tgt_is_causal=True).pow(2).mean()


def _seq(path, n, suffix=""):
    return [f"{path}.{i}{suffix}" for i in range(n)]


# name -> (builder, expected block modules, expected norm class names)
MODELS = {
    "nanogpt": (nanogpt, _seq("transformer.h", 2), {"LayerNorm"}),
    "xt_decoder": (functools.partial(_xt, encoder=False), _seq("attn_layers.layers", 4, ".1"), {"LayerNorm"}),
    "xt_encoder": (functools.partial(_xt, encoder=True), _seq("attn_layers.layers", 4, ".1"), {"RMSNorm"}),
    "llama": (_hf_causal(transformers.LlamaForCausalLM, transformers.LlamaConfig), _seq("model.layers", 2), {"LlamaRMSNorm"}),
    "mistral": (_hf_causal(transformers.MistralForCausalLM, transformers.MistralConfig), _seq("model.layers", 2), {"MistralRMSNorm"}),
    "qwen2": (_hf_causal(transformers.Qwen2ForCausalLM, transformers.Qwen2Config), _seq("model.layers", 2), {"Qwen2RMSNorm"}),
    "gemma": (_hf_causal(transformers.GemmaForCausalLM, transformers.GemmaConfig, head_dim=16), _seq("model.layers", 2), {"GemmaRMSNorm"}),
    "gpt_neox": (gpt_neox, _seq("gpt_neox.layers", 2), {"LayerNorm"}),
    "gpt2": (gpt2, _seq("transformer.h", 2), {"LayerNorm"}),
    "bert": (bert, _seq("bert.encoder.layer", 2), {"LayerNorm"}),
    "albert": (albert, [], {"LayerNorm"}),  # one shared layer called twice: no block list
    "t5": (t5, _seq("encoder.block", 2) + _seq("decoder.block", 2), {"T5LayerNorm"}),
    "vit": (vit, _seq("vit.layers", 2), {"LayerNorm"}),
    "wav2vec2": (_wav2vec2(False), _seq("wav2vec2.encoder.layers", 2), {"GroupNorm", "LayerNorm"}),
    "wav2vec2_stable": (_wav2vec2(True), _seq("wav2vec2.feature_extractor.conv_layers", 2) + _seq("wav2vec2.encoder.layers", 2),
                        {"LayerNorm"}),
    "patchtst": (patchtst, _seq("model.encoder.layers", 2), {"BatchNorm1d"}),
    "torch_transformer": (torch_transformer, _seq("encoder.layers", 2) + _seq("decoder.layers", 2), {"LayerNorm"}),
}
NAMES = sorted(MODELS)


def build(name, p=0.0, perturb=False):
    torch.manual_seed(0)
    model, run = MODELS[name][0](p)
    model.train()
    if perturb:  # norm gains away from 1 (Gemma's start at 0), so w/σ and ln_gain see them
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, m in norm_modules(model).items():
                for prm in m.parameters():
                    prm.add_(0.3 * torch.randn(prm.shape, generator=g))
    return model, run


# -- the site rules, derived from named_modules() --------------------------------------------------
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _holds_params(m):
    return m is not None and any(True for _ in m.parameters())


_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def _gain_wrapper(m: nn.Module) -> bool:
    """A *Norm class holding one parameter-free torch norm and its own gain (x-transformers' LayerNorm)."""
    kids = list(m.children())
    return (type(m).__name__.endswith("Norm") and len(kids) == 1 and isinstance(kids[0], _TORCH_NORMS)
            and not list(kids[0].parameters()))


def is_norm(name: str, m: nn.Module) -> bool:
    if ".parametrizations." in f".{name}.":
        return False  # torch.nn.utils.parametrizations.weight_norm's _WeightNorm: not an activation norm
    if isinstance(m, _TORCH_NORMS):
        return True
    return (type(m).__name__.endswith("Norm") and (not list(m.children()) or _gain_wrapper(m))
            and all(prm.dim() <= 1 for prm in m.parameters(recurse=False)))


def norm_modules(model) -> dict[str, nn.Module]:
    found = {n: m for n, m in model.named_modules() if is_norm(n, m)}
    return {n: m for n, m in found.items() if not (n.rpartition(".")[0] in found and _gain_wrapper(found[n.rpartition(".")[0]]))}


def _block_lists(model) -> list[tuple[str, list[nn.Module]]]:
    lists = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or any(name.startswith(f"{p}.") for p, _ in lists):
            continue
        kids = list(m._modules.values())
        if len(kids) >= 2 and all(_holds_params(k) for k in kids) and len({type(k) for k in kids}) == 1:
            lists.append((name, kids))
    return lists


def block_modules(model) -> dict[str, nn.Module]:
    blocks = {}
    for name, kids in _block_lists(model):
        for i, kid in enumerate(kids):
            if isinstance(kid, _CONTAINERS):
                inner = [(c, sub) for c, sub in kid.named_children() if _holds_params(sub) and not isinstance(sub, _CONTAINERS)]
                assert len(inner) == 1, f"{name}.{i}: no single block inside {[c for c, _ in inner]}"
                blocks[f"{name}.{i}.{inner[0][0]}"] = inner[0][1]
            else:
                blocks[f"{name}.{i}"] = kid
    return blocks


# -- references -----------------------------------------------------------------------------------
_first_tensor = _first  # a module output's main tensor (recorder_ref)


def _main_input(args, kwargs):
    """(tensor, rebuild): the first positional floating tensor, else the first floating tensor kwarg."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a, lambda v, i=i: ((*args[:i], v, *args[i + 1:]), kwargs)
    for k, a in kwargs.items():
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a, lambda v, k=k: (args, {**kwargs, k: v})
    return None, None


def reference(model, run, targets: dict[str, nn.Module], norms: set[str]):
    """Runs ``run()`` once with hooks on ``targets``; site ``{name}.in|out`` (``#k`` for call k >= 2).

    A norm's input is replaced by a view, so its gradient is the one through the norm alone.

    Returns:
        (site -> ‖∂loss/∂site‖ or None when the site's tensor does not require grad,
         site -> detached forward value)
    """
    captured, calls, handles = {}, collections.Counter(), []

    def sfx(name):
        return "" if calls[name] == 1 else f"#{calls[name]}"

    for name, module in targets.items():
        def pre(mod, args, kwargs, name=name):
            calls[name] += 1
            x, rebuild = _main_input(args, kwargs)
            if x is None:
                return None
            if name in norms:
                x = x.view_as(x)
                captured[f"{name}.in{sfx(name)}"] = x
                return rebuild(x)
            captured[f"{name}.in{sfx(name)}"] = x
            return None

        def post(mod, args, out, name=name):
            t = _first_tensor(out)
            if t is not None:
                captured[f"{name}.out{sfx(name)}"] = t

        handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]
    try:
        loss = run()
        names = [n for n, t in captured.items() if t.requires_grad]
        grads = torch.autograd.grad(loss, [captured[n] for n in names], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    norm_of = {n: (0.0 if g is None else g.norm().item()) for n, g in zip(names, grads)}
    return {n: norm_of.get(n) for n in captured}, {n: t.detach() for n, t in captured.items()}


def param_grad_reference(model, run, groups: list[str]) -> dict[str, float]:
    """group (a module or parameter name, "" = whole model) -> sqrt(Σ ‖∂loss/∂p‖²) over that module's unique parameters."""
    params = [q for q in model.parameters() if q.requires_grad]  # unique parameters (tied ones once)
    grads = dict(zip(map(id, params), torch.autograd.grad(run(), params, allow_unused=True)))
    out = {}
    named = dict(model.named_parameters())
    for g in groups:  # a group names a module, or one parameter (a module's own, beside its children's groups)
        sub = [named[g]] if g in named else (model if g == "" else model.get_submodule(g)).parameters()
        out[g] = math.sqrt(sum(grads[id(q)].double().norm().item() ** 2 for q in sub if grads.get(id(q)) is not None))
    return out


def w_over_sigma_reference(module: nn.Module, x: torch.Tensor) -> float | None:
    """mean over tokens and features of g_f/σ_t, computed from the norm's input; None for other norms."""
    x = x.double()
    cls = type(module).__name__
    if isinstance(module, (nn.LayerNorm, LayerNorm)):
        nd = len(module.normalized_shape) if isinstance(module, nn.LayerNorm) else 1
        sigma = torch.sqrt(x.var(dim=tuple(range(-nd, 0)), unbiased=False) + getattr(module, "eps", 1e-5))
        gain = module.weight if module.weight is not None else torch.ones(x.shape[-nd:])
    elif cls in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "T5LayerNorm"):
        sigma, gain = torch.sqrt(x.pow(2).mean(-1) + module.variance_epsilon), module.weight
    elif cls == "GemmaRMSNorm":
        sigma, gain = torch.sqrt(x.pow(2).mean(-1) + module.eps), 1.0 + module.weight
    else:
        return None
    return (gain.detach().double().reshape(1, -1) / sigma.reshape(-1, 1)).mean().item()


def _module_of(site: str) -> tuple[str, str, int]:
    """'a.b.out#2' -> ('a.b', 'out', 2)."""
    base, _, k = site.partition("#")
    name, _, where = base.rpartition(".")
    return name, where, int(k) if k else 1


# -- one recorded step per model, shared by the value tests ----------------------------------------
@functools.lru_cache(maxsize=None)
def recorded(name):
    model, run = build(name, perturb=True)
    with gradscope.record(model, quantities=VALUE_QUANTITIES) as rec:
        run().backward()
    df = rec.frame()
    model.zero_grad(set_to_none=True)
    return model, run, df[df.micro_step == -1]


@functools.lru_cache(maxsize=None)
def expected(name):
    """Reference on a fresh model (same seed): blocks, norms, site gradients and values."""
    model, run = build(name, perturb=True)
    blocks, norms = block_modules(model), norm_modules(model)
    grads, values = reference(model, run, {**blocks, **norms}, set(norms))
    return model, run, blocks, norms, grads, values


def _rows(df, quantity):
    rows = df[df.quantity == quantity]
    assert not rows.site.duplicated().any(), f"{quantity}: duplicated sites {rows.site[rows.site.duplicated()].tolist()}"
    return dict(zip(rows.site, rows.value))


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_rules_derive_the_expected_layout(name):
    """Self-check of this file's rule derivation (no recorder involved)."""
    model, _ = build(name)
    assert list(block_modules(model)) == MODELS[name][1]
    norms = norm_modules(model)
    assert norms and {type(m).__name__ for m in norms.values()} == MODELS[name][2]


@pytest.mark.parametrize("name", NAMES)
def test_act_grad_norm_at_every_site_equals_autograd(name):
    model, run, blocks, norms, ref, values = expected(name)
    _, _, df = recorded(name)
    got, act = _rows(df, "act_grad_norm"), _rows(df, "act_norm")
    # the blocks and norms the rules name are all reported (a site whose tensor needs no grad may lack a gradient)
    for b in blocks:
        for where in ("in", "out"):
            site = f"{b}.{where}"
            assert site in act, f"block site {site} missing; reported: {sorted(act)[:12]}"
            assert ref.get(site) is None or site in got, f"no act_grad_norm at {site}"
    for n in norms:
        lacking = [f"{n}.{w}" for w in ("in", "out") if f"{n}.{w}" not in got]
        assert not lacking, f"norm sites missing: {lacking}"
    missing = [s for s, v in ref.items() if v is not None and v > 0 and s not in got]
    assert not missing, f"reference sites not reported: {missing}"
    # every reported .in/.out site (expected or not) equals autograd at the same place
    sites = [s for s in got if _module_of(s)[1] in ("in", "out")]
    extra = {m for m, where, _ in map(_module_of, [*got, *act]) if where in ("in", "out") and m not in blocks and m not in norms}
    if extra:
        modules = dict(model.named_modules())
        unknown = sorted(m for m in extra if m not in modules)
        assert not unknown, f"sites on no module: {unknown}"
        ref_x, values_x = reference(model, run, {m: modules[m] for m in extra}, set())
        ref, values = {**ref_x, **ref}, {**values_x, **values}
    for site in sites:
        expected_grad = ref.get(site)
        assert site in values, f"{site}: the module was not called with a tensor there"
        if expected_grad is None:
            assert got[site] == 0.0, f"{site}: no gradient reaches it, recorder says {got[site]}"
        else:
            assert_rel(got[site], expected_grad, what=f"act_grad_norm {site}")
    for site, value in act.items():
        if _module_of(site)[1] in ("in", "out"):
            assert site in values, f"{site}: the module was not called with a tensor there"
            assert_rel(value, values[site].double().norm().item(), what=f"act_norm {site}")


def _sublayers(prefix: str, module) -> list[str]:
    """The sub-layer groups the docs promise (docs/table.md): the children that hold
    parameters; a list's entries instead of the list; a lone child's children instead of it
    (its group would be the block's) unless all its parameters are its own."""
    kids = [(c, sub) for c, sub in module.named_children() if _holds_params(sub)]
    if len(kids) == 1 and not list(module.parameters(recurse=False)) and not isinstance(kids[0][1], torch.nn.ModuleList):
        c, sub = kids[0]
        own_only = not any(_holds_params(s) for s in sub.children())
        return [] if own_only else _sublayers(f"{prefix}.{c}", sub)
    out = []
    for c, sub in kids:
        if isinstance(sub, torch.nn.ModuleList):
            out += [f"{prefix}.{c}.{k}" for k, entry in sub.named_children() if _holds_params(entry)]
        else:
            out.append(f"{prefix}.{c}")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_param_grad_norm_total_and_per_block(name):
    model, run, df = recorded(name)
    got = _rows(df, "param_grad_norm")
    required = [""]
    for b, block in block_modules(model).items():  # the block whose sites are b.in / b.out, and its sub-layers
        required += [b] + _sublayers(b, block)
    missing = [g for g in required if g not in got]
    assert not missing, f"param_grad_norm groups missing: {missing}; reported {sorted(got)[:10]}"
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    unknown = [g for g in got if g not in modules and g not in params]  # a module's own parameters beside its
    assert not unknown, f"groups that name no module or parameter: {unknown}"  # children's groups: one group each
    ref = param_grad_reference(model, run, list(got))
    for group, value in got.items():
        assert_rel(value, ref[group], what=f"param_grad_norm {group!r}")


@pytest.mark.parametrize("name", NAMES)
def test_site_roles(name):
    _, _, blocks, norms, _, _ = expected(name)
    _, _, df = recorded(name)
    assert "role" in df.columns, "the table has no role column"
    rows = df[df.quantity == "act_norm"]
    role = dict(zip(rows.site, rows.role))
    # a norm outside the blocks whose parameter group is the model's final norm is named so at its sites too
    groups = df[df.quantity == "param_grad_norm"]
    final = set(groups.loc[groups.role == "final_norm", "site"])
    kind = {n: "final_norm" if n in final else "norm" for n in norms}
    want = {**{f"{b}.in": "layer_in" for b in blocks}, **{f"{b}.out": "layer_out" for b in blocks},
            **{f"{n}.in": f"{kind[n]}_in" for n in norms}, **{f"{n}.out": f"{kind[n]}_out" for n in norms}}
    for site, r in role.items():
        base = site.partition("#")[0]
        if base in want:
            assert r == want[base], f"{site}: role {r!r}, expected {want[base]!r}"
    assert set(want) <= set(role), f"sites without rows: {sorted(set(want) - set(role))}"


def _per_call(norm: str, got: dict, per_call: dict[int, float], aggregate: float, quantity: str) -> None:
    """Rows ``N``, ``N#2``... per call, or (repeatedly called norm) one ``N`` row for all calls."""
    if any(f"{norm}#{k}" in got for k in per_call if k > 1) or len(per_call) == 1:
        for k, want in per_call.items():
            site = norm if k == 1 else f"{norm}#{k}"
            assert site in got, f"{quantity}: no row for {site}"
            assert_rel(got[site], want, what=f"{quantity} {site}")
    else:
        assert norm in got, f"{quantity}: no row for {norm}"
        assert_rel(got[norm], aggregate, what=f"{quantity} {norm} (all {len(per_call)} calls)")


@pytest.mark.parametrize("name", NAMES)
def test_ln_gain_and_w_over_sigma(name):
    model, run, _, norms, ref, values = expected(name)
    # self-check of the reference: first-call gains agree with recorder_ref.norm_gains
    for n, g in norm_gains(model, norms, run).items():
        assert_rel(ref[f"{n}.in"] / ref[f"{n}.out"], g, what=f"reference gain {n}")
    _, _, df = recorded(name)
    gains, wsig = _rows(df, "ln_gain"), _rows(df, "ln_w_over_sigma")
    gain_at = {s.partition("#")[0] for s in gains}
    assert gain_at == set(norms), f"ln_gain rows: missing {sorted(set(norms) - gain_at)}, not norms {sorted(gain_at - set(norms))}"
    not_norms = sorted({s.partition("#")[0] for s in wsig} - set(norms))
    assert not not_norms, f"ln_w_over_sigma rows on modules that are not norms: {not_norms}"
    for n, module in norms.items():
        ks = sorted(_module_of(s)[2] for s in values if _module_of(s)[:2] == (n, "in"))
        sites = {k: ("" if k == 1 else f"#{k}") for k in ks}
        g_in = {k: ref[f"{n}.in{s}"] for k, s in sites.items()}
        g_out = {k: ref[f"{n}.out{s}"] for k, s in sites.items()}
        _per_call(n, gains, {k: g_in[k] / g_out[k] for k in ks},
                  math.sqrt(sum(v * v for v in g_in.values())) / math.sqrt(sum(v * v for v in g_out.values())), "ln_gain")
        w = {k: w_over_sigma_reference(module, values[f"{n}.in{s}"]) for k, s in sites.items()}
        if None not in w.values():
            _per_call(n, wsig, w, sum(w.values()) / len(w), "ln_w_over_sigma")


def _train(name, record):
    model, run = build(name, p=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt) if record else None
    losses = []
    for step in range(3):
        with rec.step(step) if rec is not None else contextlib.nullcontext():
            loss = run()
            loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    rng = torch.get_rng_state()
    df = None
    if rec is not None:
        df = rec.frame()
        rec.close()
    return model, losses, rng, df


@pytest.mark.parametrize("name", NAMES)
def test_training_bit_identical_with_dropout(name):
    plain, plain_losses, plain_rng, _ = _train(name, record=False)
    rec_model, rec_losses, rec_rng, df = _train(name, record=True)
    assert set(df.step) == {0, 1, 2} and (df.quantity == "act_grad_norm").any()
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, rec_losses)), f"losses {plain_losses} vs {rec_losses}"
    for (n, p), (_, q) in zip(plain.named_parameters(), rec_model.named_parameters()):
        assert torch.equal(p, q), f"parameter {n} differs"
    for (n, b), (_, c) in zip(plain.named_buffers(), rec_model.named_buffers()):
        assert torch.equal(b, c), f"buffer {n} differs"
    assert torch.equal(plain_rng, rec_rng), "the recorder changed the global RNG state"


@pytest.mark.parametrize("name", NAMES)
def test_close_removes_every_hook(name):
    from torch.nn.modules import module as module_mod

    global_dicts = [getattr(module_mod, a) for a in dir(module_mod) if a.startswith("_global_") and a.endswith("hooks")
                    and isinstance(getattr(module_mod, a), dict)]
    before = [len(d) for d in global_dicts]
    model, run = build(name, p=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rec = gradscope.Recorder(model, quantities="all", optimizer=opt)
    with rec.step(0):
        run().backward()
    opt.step()
    rec.close()
    assert all_hook_dicts_empty(model) == []
    assert [len(d) for d in global_dicts] == before, "global module hooks left"
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks, "optimizer hooks left"
