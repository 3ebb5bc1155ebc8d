"""The attention signals of a hand-written attention (``q_proj``/``k_proj``, nanoGPT's
``n_head``) under the masks a user passes: none, a (B, S) key-padding mask of ints or
bools, one that is ambiguous (B = T); with and without ``is_causal``. Reference: logits
recomputed in the test from the q and k of a twin's projections, with padded positions
counted neither as keys nor as queries."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope
from gradscope.recorder.capture.signals import allowed_keys


class Attention(nn.Module):
    def __init__(self, d: int = 16, n_head: int = 2, causal: bool | None = None) -> None:
        super().__init__()
        self.n_head = n_head
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        if causal is not None:
            self.is_causal = causal

    def forward(self, x, attn_mask=None):
        B, T, d = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        keep = torch.ones(T, T, dtype=torch.bool).tril()  # causal inside, as nanoGPT does
        if attn_mask is not None:
            keep = keep & attn_mask.bool()[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(B, T, d)


class Net(nn.Module):
    def __init__(self, causal: bool | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList([Attention(causal=causal), Attention(causal=causal)])

    def forward(self, ids, attn_mask=None):
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h, attn_mask)
        return h


def reference(model: Net, ids, pad: torch.Tensor | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per block: (max logit per head, mean entropy per head) over real queries and keys."""
    out, seen = {}, {}
    hooks = [b.register_forward_pre_hook(lambda m, a, name=f"blocks.{i}": seen.__setitem__(name, a[0].detach()))
             for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        model(ids, pad)
    for h in hooks:
        h.remove()
    B, T = ids.shape
    real = torch.ones(B, T, dtype=torch.bool) if pad is None else pad.bool()
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & real[:, None, None, :] & real[:, None, :, None]
    for i, block in enumerate(model.blocks):
        x = seen[f"blocks.{i}"]
        q = block.q_proj(x).view(B, T, 2, -1).transpose(1, 2)
        k = block.k_proj(x).view(B, T, 2, -1).transpose(1, 2)
        logits = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).double().masked_fill(~allowed, -math.inf)
        p = logits.softmax(-1).nan_to_num(0.0)
        entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
        valid = allowed.expand_as(logits).any(-1)
        out[f"blocks.{i}"] = (logits.amax(dim=(0, 2, 3)), (entropy * valid).sum(dim=(0, 2)) / valid.sum(dim=(0, 2)))
    return out


def recorded(model: Net, ids, pad):
    rec = gradscope.Recorder(model, quantities=["attn_logit_max", "attn_entropy"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec.step(0):
            model(ids, pad).square().mean().backward()
        frame = rec.frame()
    rec.close()
    heads = frame[frame.layer_j.notna()].sort_values("layer_j")
    values = {(site, q): torch.tensor(g.value.to_numpy(), dtype=torch.float64)
              for (site, q), g in heads.groupby(["site", "quantity"])}
    return values, [str(w.message) for w in caught]


@pytest.mark.parametrize("dtype", [torch.long, torch.bool])
def test_a_causal_attention_with_a_key_padding_mask_equals_the_recomputation(dtype):
    torch.manual_seed(0)
    model, ids = Net(causal=True), torch.randint(0, 20, (3, 8))
    pad = torch.ones(3, 8, dtype=dtype)
    pad[0, 5:] = 0
    pad[2, 3:] = 0
    ref = reference(copy.deepcopy(model), ids, pad)
    values, said = recorded(model, ids, pad)
    assert not [s for s in said if "attention" in s], said
    for site, (top, entropy) in ref.items():
        torch.testing.assert_close(values[(site, "attn_logit_max")], top, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(values[(site, "attn_entropy")], entropy, rtol=1e-5, atol=1e-6)


def test_an_attention_that_does_not_say_whether_it_is_causal_has_no_rows_and_a_warning():
    """Causal inside (nanoGPT's triangle), no mask over queries, no is_causal attribute: which
    keys a query sees is not known, so no rows (read as bidirectional, its max logit was 37 %
    off), and the warning says which attribute to set."""
    torch.manual_seed(0)
    model, ids = Net(causal=None), torch.randint(0, 20, (3, 8))
    for pad in (None, torch.ones(3, 8, dtype=torch.long)):  # (a mask of padded keys says nothing of causality)
        values, said = recorded(copy.deepcopy(model), ids, pad)
        assert not values
        assert any("has no is_causal attribute" in s and "'blocks.0'" in s and "set is_causal" in s for s in said), said


def test_a_mask_that_could_be_either_kind_gives_no_rows_and_says_why():
    torch.manual_seed(0)
    model, ids = Net(causal=True), torch.randint(0, 20, (8, 8))  # B = T: (B, S) or (T, S)?
    values, said = recorded(model, ids, torch.ones(8, 8, dtype=torch.long))
    assert not values
    assert any("could be either" in s for s in said), said


def test_allowed_keys_reads_each_kind_of_mask():
    idx = torch.arange(4)
    padding = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    got = allowed_keys(padding, B=2, T=4, S=4, idx=idx, causal=False)
    assert got.shape == (2, 1, 1, 4) and got[1, 0, 0].tolist() == [True, True, False, False]
    additive = torch.zeros(2, 1, 4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -torch.inf)
    assert allowed_keys(additive, B=2, T=4, S=4, idx=idx, causal=False)[0, 0].equal(torch.ones(4, 4).tril().bool())
    combined = allowed_keys(padding.bool(), B=2, T=4, S=4, idx=idx, causal=True)  # padding and the triangle
    assert combined[0, 0].equal(torch.ones(4, 4).tril().bool() & torch.tensor([True, True, True, False]))
    assert isinstance(allowed_keys(torch.ones(3, 5), B=2, T=4, S=4, idx=idx, causal=False), str)


class CrossAttention(nn.Module):
    """BART-style cross-attention: queries from the decoder, keys from the encoder (`enc`)."""

    is_causal = False

    def __init__(self, d: int = 16, num_heads: int = 2) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, enc, attention_mask=None):
        B, T, d = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, -1).transpose(1, 2)
        k, v = (p(enc).view(B, enc.shape[1], self.num_heads, -1).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        keep = attention_mask.bool()[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(B, T, d)


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList([CrossAttention(), CrossAttention()])

    def forward(self, ids, enc_ids, enc_mask):
        x, enc = self.embed(ids), self.embed(enc_ids)
        for b in self.blocks:
            x = x + b(x, enc, attention_mask=enc_mask)
        return x


def test_cross_attention_with_as_many_keys_as_queries_counts_every_query():
    """Source and target padded to one length (S = T): a padded encoder key is no padded
    decoder query, so every query counts (the padded-query rule is self-attention's)."""
    torch.manual_seed(0)
    model, ids, enc_ids = Seq2Seq(), torch.randint(0, 20, (2, 4)), torch.randint(0, 20, (2, 4))
    enc_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    twin, seen = copy.deepcopy(model), {}
    hooks = [b.register_forward_pre_hook(lambda m, a, k=k: seen.__setitem__(k, a[0].detach()))
             for k, b in enumerate(twin.blocks)]
    with torch.no_grad():
        twin(ids, enc_ids, enc_mask)
    for h in hooks:
        h.remove()
    rec = gradscope.Recorder(model, quantities=["attn_entropy"])
    with rec.step(0):
        model(ids, enc_ids, enc_mask).square().mean().backward()
    frame = rec.frame()
    rec.close()
    enc = twin.embed(enc_ids).detach()
    for k, block in enumerate(twin.blocks):
        q = block.q_proj(seen[k]).view(2, 4, 2, -1).transpose(1, 2)
        key = block.k_proj(enc).view(2, 4, 2, -1).transpose(1, 2)
        logits = (q @ key.transpose(-1, -2) / math.sqrt(8)).double().masked_fill(~enc_mask.bool()[:, None, None, :],
                                                                                    -math.inf)
        p = logits.softmax(-1)
        entropy = -(p * p.clamp_min(1e-300).log()).sum(-1).mean(dim=(0, 2))  # every query
        got = frame[(frame.site == f"blocks.{k}") & frame.layer_j.notna()].sort_values("layer_j").value
        torch.testing.assert_close(torch.tensor(got.to_numpy(), dtype=torch.float64), entropy, rtol=1e-5, atol=1e-6)


def test_hand_written_additive_masks_mask():
    idx = torch.arange(3)
    for masked in (-1e4, -1e9, -torch.inf, torch.finfo(torch.float32).min):
        mask = torch.tensor([[0.0, 0.0, masked]])
        assert not allowed_keys(mask, 1, 3, 3, idx, False)[..., 2].any()
    assert allowed_keys(torch.tensor([[0.0, 0.0, -30.0]]), 1, 3, 3, idx, False)[..., 2].all()  # (a bias, as ALiBi's)


def test_a_padding_mask_under_compile_with_a_changing_batch_size():
    """Dynamo makes the batch dimension dynamic at the second size; reading the mask must not
    break the compiled forward (a bool compared with a SymBool did)."""
    torch.manual_seed(0)
    model = Net(causal=True)
    rec = gradscope.Recorder(model, quantities=["attn_logit_max"])
    compiled = torch.compile(model, fullgraph=True)
    for step, batch in enumerate((2, 3, 5)):
        ids, pad = torch.randint(0, 20, (batch, 6)), torch.ones(batch, 6, dtype=torch.long)
        pad[0, 4:] = 0
        with rec.step(step):
            compiled(ids, pad).square().mean().backward()
    frame = rec.frame()
    rec.close()
    assert sorted(set(frame.step)) == [0, 1, 2]
