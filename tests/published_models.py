"""Published architectures built tiny with random weights (nothing downloaded), for the
recorder's tests (tests/test_recorder_published.py and others): a nanoGPT written here,
x-transformers, HuggingFace models from their config classes and ``torch.nn.Transformer``.
``MODELS[name][0](p)`` returns ``(model, run)``, ``run()`` the loss (dropout ``p``);
``published_rules.build`` seeds and perturbs it."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn


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
