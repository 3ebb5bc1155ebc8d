"""Models nobody here wrote, for the outlier and weight statistics' tests (issue 52): HF GPT-2,
Llama and BERT built from tiny configs, torch.nn.TransformerEncoder, and a nanoGPT-style model
written here. Dropout is off so that a twin (a deep copy) computes the same numbers."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D = 40, 16


def layer_norm(block: int, d: int) -> nn.Module:
    """The norm of every block by default: ``nn.LayerNorm``."""
    return nn.LayerNorm(d)


class Block(nn.Module):
    def __init__(self, d: int, norm: Callable[[int], nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = norm(d), norm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, 2, C // 2).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's shape; ``block_norm(i, d)`` makes block i's norms (tests that need hand-written ones)."""

    def __init__(self, vocab: int = VOCAB, d: int = D, n: int = 2,
                 block_norm: Callable[[int, int], nn.Module] = layer_norm) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList([Block(d, lambda width, i=i: block_norm(i, width)) for i in range(n)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


class Encoder(nn.Module):
    """torch.nn.TransformerEncoder under an embedding and a head."""

    def __init__(self, vocab: int = VOCAB, d: int = D, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (enable_nested_tensor with norm_first: not used in training)
            self.encoder = nn.TransformerEncoder(layer, n)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.encoder(self.embed(idx)))


def hf(kind: str, n: int = 2) -> nn.Module:
    """A tiny HF model of ``n`` layers from its config (random weights, dropout off)."""
    import transformers as T

    if kind == "gpt2":
        cfg = T.GPT2Config(n_embd=D, n_layer=n, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = T.LlamaConfig(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=n, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0,
                            eos_token_id=0, pad_token_id=0)
        return T.LlamaForCausalLM(cfg)
    if kind == "bert":
        cfg = T.BertConfig(hidden_size=D, num_hidden_layers=n, num_attention_heads=2, intermediate_size=2 * D,
                           vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
        return T.BertForMaskedLM(cfg)
    raise ValueError(kind)


MODELS = ("nanogpt", "encoder", "gpt2", "llama", "bert")


def build(kind: str, layers: int = 2) -> nn.Module:
    """Model ``kind`` (:data:`MODELS`) of ``layers`` layers (compiled tests take 1: less to compile)."""
    return NanoGPT(n=layers) if kind == "nanogpt" else Encoder(n=layers) if kind == "encoder" else hf(kind, layers)


def embedding(model: nn.Module) -> nn.Embedding:
    """The model's token embedding (its first nn.Embedding)."""
    return next(m for m in model.modules() if isinstance(m, nn.Embedding))


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
