"""The ``moe`` quantities on HuggingFace MoE models built from their configs (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS; Switch Transformers for the capacity),
eager and under ``torch.compile(fullgraph=True)``, against references computed here: the
routing statistics from the model's own router logits (``output_router_logits=True``),
the per-expert norms from slices of ``p.grad`` and of the fused 3-D expert tensors."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import gradscope
from gradscope.recorder.discovery.routers import find_routers

V, T, B = 64, 8, 2
ATTN = dict(vocab_size=V, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


def _config(family: str, layers: int, experts_impl: str | None):
    k = dict(num_hidden_layers=layers, num_experts_per_tok=2)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**ATTN, **k, intermediate_size=16, num_local_experts=4)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**ATTN, **k, intermediate_size=16, moe_intermediate_size=8, num_experts=4,
                                shared_expert_intermediate_size=8, decoder_sparse_step=1, norm_topk_prob=False)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**ATTN, **k, head_dim=8, intermediate_size=16, moe_intermediate_size=8, num_experts=4,
                                decoder_sparse_step=1)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**ATTN, **k, intermediate_size=8, num_experts=4)
    elif family == "deepseek_v3":  # (one group: its group-limited choice is the top-k of its scores)
        cfg = tf.DeepseekV3Config(**{**ATTN, "num_key_value_heads": 2}, **k, intermediate_size=16, moe_intermediate_size=8,
                                  n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
                                  q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    elif family == "gpt_oss":
        cfg = tf.GptOssConfig(**ATTN, **k, head_dim=8, intermediate_size=8, num_local_experts=4,
                              layer_types=["full_attention"] * layers)
    else:
        raise ValueError(family)
    if experts_impl is not None:
        cfg._experts_implementation = experts_impl
    return cfg


def build(family: str, layers: int = 2, experts_impl: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(family, layers, experts_impl)).float()
    with torch.no_grad():  # (decisive routing: some routers start at zero, where every expert ties)
        for r in find_routers(model):
            for p in r.module.parameters():
                p.normal_(0.0, 1.0)
    return model


def routing_reference(logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """The routing statistics of one MoE layer from its router logits (N, E), top-k routing."""
    logits = logits.detach().double()
    E = logits.shape[-1]
    chosen = logits.topk(k, dim=-1).indices  # (softmax, sigmoid and GPT-OSS's logits top-k choose alike)
    counts = torch.bincount(chosen.reshape(-1), minlength=E).double()
    p = logits.softmax(-1)
    return {
        "moe_load": counts / counts.sum(),
        "moe_imbalance": counts.max() / counts.mean(),
        "moe_load_cv": counts.std(unbiased=False) / counts.mean(),
        "router_entropy": torch.distributions.Categorical(logits=logits).entropy().mean(),
        "router_z": torch.logsumexp(logits, -1).square().mean(),
        "router_topk_mass": p.gather(1, chosen).sum(-1).mean(),
    }


def recorded(df, quantity: str, site: str):
    rows = df[(df["quantity"] == quantity) & (df["site"] == site) & (df["step"] == 0)].sort_values("layer_j")
    return torch.tensor(rows["value"].to_numpy(), dtype=torch.float64)


def run(family: str, compiled: bool, layers: int = 2, experts_impl: str | None = None, backend: str = "inductor"):
    model = build(family, layers, experts_impl)
    rec = gradscope.Recorder(model, quantities="moe")
    call = torch.compile(model, fullgraph=True, backend=backend) if compiled else model
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    with rec.step(0):
        out = call(x, labels=x, output_router_logits=not compiled)
        out.loss.backward()
    rec.close()
    if compiled:  # (transformers' output recording takes a lock, which Dynamo cannot trace: the eager model's,
        with torch.no_grad():  # same weights and input)
            out = model(x, output_router_logits=True)
    return model, rec.frame(), out


def check(family: str, model: nn.Module, df, out) -> None:
    routers = find_routers(model)
    assert routers and len(out.router_logits) == len(routers)
    for r, logits in zip(routers, out.router_logits):
        ref = routing_reference(logits, r.module.top_k)
        for quantity, want in ref.items():
            got = recorded(df, quantity, r.block)
            assert got.numel() == want.numel(), (family, quantity, r.block)
            torch.testing.assert_close(got, want.reshape(-1), rtol=1e-5, atol=1e-6, msg=f"{family} {quantity} {r.block}")
        assert recorded(df, "moe_dropped_frac", r.block).numel() == 0  # (no capacity: no row)
        experts = model.get_submodule(r.experts)
        fused = [p for p in experts.parameters() if p.shape[0] == r.num_experts]
        assert fused and all(p.dim() >= 2 for p in fused)
        for quantity, of in (("expert_grad_norm", lambda p: p.grad), ("expert_param_norm", lambda p: p.detach())):
            want = torch.stack([torch.stack([of(p)[e].double().norm() for p in fused]).norm() for e in range(r.num_experts)])
            got = torch.tensor([recorded(df, quantity, f"{r.experts}.{e}").item() for e in range(r.num_experts)],
                               dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9, msg=f"{family} {quantity} {r.experts}")


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_and_experts_eager(family):
    model, df, out = run(family, compiled=False)
    check(family, model, df, out)


# Compiled: the experts' default loop over the experts hit is data-dependent (a graph break), so these
# use transformers' "batched_mm" experts, which compile with fullgraph=True. Inductor for one
# family; Dynamo and AOT autograd (backend "aot_eager") for the others, to keep the test short.
@pytest.mark.parametrize("family, backend", [("mixtral", "inductor"), ("qwen3_moe", "aot_eager"),
                                             ("olmoe", "aot_eager"), ("gpt_oss", "aot_eager")])
def test_routing_and_experts_compiled(family, backend):
    torch._dynamo.reset()
    model, df, out = run(family, compiled=True, layers=1, experts_impl="batched_mm", backend=backend)
    check(family, model, df, out)


def test_shared_expert_is_a_group_of_its_own():
    """Qwen2-MoE's shared_expert and DeepSeek-V3's shared_experts: param_grad_norm rows of their own."""
    for family, shared in (("qwen2_moe", "shared_expert"), ("deepseek_v3", "shared_experts")):
        model, df, _ = run(family, compiled=False, layers=2)  # (with one layer there are no repeated blocks)
        r = find_routers(model)[0]
        site = f"{r.block}.{shared}"
        want = torch.stack([p.grad.double().norm() for p in model.get_submodule(site).parameters()]).norm()
        torch.testing.assert_close(recorded(df, "param_grad_norm", site), want.reshape(1), rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(recorded(df, "param_grad_norm", r.name),  # (the router: a group of its own too)
                                   torch.stack([p.grad.double().norm() for p in r.module.parameters()]).norm().reshape(1))
        per_expert = df[df["site"].str.startswith(f"{r.experts}.")]
        assert set(per_expert["quantity"]) == {"expert_grad_norm", "expert_param_norm"}


@pytest.mark.parametrize("compiled", [False, True])
def test_switch_capacity_drops_are_counted(compiled):
    """Switch Transformers: top-1 routing with an expert capacity per sequence; the load counts
    the router's choices, ``moe_dropped_frac`` those beyond the capacity; its experts, a
    ModuleDict of E MLPs, one expert each. Compiled without fullgraph (its experts' loop over
    the experts hit breaks the graph, with or without gradscope; the routers compile)."""
    torch.manual_seed(0)
    cfg = tf.SwitchTransformersConfig(vocab_size=V, d_model=16, d_kv=8, d_ff=16, num_layers=2, num_decoder_layers=2,
                                      num_heads=2, num_experts=4, expert_capacity=2, num_sparse_encoder_layers=2,
                                      num_sparse_decoder_layers=2, decoder_start_token_id=0, pad_token_id=0)
    model = tf.SwitchTransformersForConditionalGeneration(cfg)
    rec = gradscope.Recorder(model, quantities=["moe_load", "moe_dropped_frac", "router_z", "expert_grad_norm"])
    x = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    call = torch.compile(model, backend="aot_eager") if compiled else model
    with rec.step(0):
        out = call(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
    rec.close()
    df = rec.frame()
    routers = find_routers(model)
    logits = [t for t in (*out.encoder_router_logits, *out.decoder_router_logits) if t is not None and t.numel()]
    assert len(routers) == len(logits) == 4 and all(r.capacity for r in routers)
    dropped_any = False
    for r, lg in zip(routers, logits):
        lg = lg.detach().double().reshape(B, -1, 4)
        choice = nn.functional.one_hot(lg.argmax(-1), 4)  # (B, T, E)
        kept = (choice * (choice.cumsum(dim=1) <= cfg.expert_capacity)).sum()
        counts = choice.sum(dim=(0, 1)).double()
        torch.testing.assert_close(recorded(df, "moe_load", r.block), counts / counts.sum())
        want = 1.0 - kept.double() / counts.sum()
        torch.testing.assert_close(recorded(df, "moe_dropped_frac", r.block), want.reshape(1))
        torch.testing.assert_close(recorded(df, "router_z", r.block),
                                   torch.logsumexp(lg, -1).square().mean().reshape(1), rtol=1e-5, atol=1e-6)
        dropped_any |= bool(want > 0)
        for e, expert in enumerate(model.get_submodule(r.experts).children()):
            grads = [p.grad.double().norm() for p in expert.parameters() if p.grad is not None]
            want = torch.stack(grads).norm() if grads else torch.zeros((), dtype=torch.float64)
            torch.testing.assert_close(recorded(df, "expert_grad_norm", f"{r.experts}.{e}"), want.reshape(1),
                                       rtol=1e-5, atol=1e-9)
    assert dropped_any  # (the capacity of 2 for 8 tokens over 4 experts drops some)


class DeclaredRouter(nn.Module):
    """A router of one's own whose name says nothing: it declares itself."""

    gradscope_router = True

    def __init__(self, d: int, E: int, k: int) -> None:
        super().__init__()
        self.proj, self.num_experts, self.top_k = nn.Linear(d, E, bias=False), E, k

    def forward(self, x):
        return self.proj(x)  # (..., E) logits only: the top-k is read from top_k


class TinyMoE(nn.Module):
    """A hand-written MoE layer with a list of expert MLPs (soft top-k mixture, dense for simplicity)."""

    def __init__(self, d: int = 8, E: int = 3, k: int = 2) -> None:
        super().__init__()
        self.chooser = DeclaredRouter(d, E, k)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(E))
        self.k = k

    def forward(self, x):
        logits = self.chooser(x)
        w, idx = logits.softmax(-1).topk(self.k, dim=-1)
        outs = torch.stack([e(x) for e in self.experts], dim=-2)  # (B, T, E, d)
        return x + (outs.gather(-2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1])) * w.unsqueeze(-1)).sum(-2)


def test_declared_router_and_expert_list():
    torch.manual_seed(0)
    model = nn.Sequential(TinyMoE(), TinyMoE())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = gradscope.Recorder(model, quantities=["moe_load", "router_entropy", "expert_grad_norm"])
    seen = {}
    handles = [m.chooser.register_forward_hook(lambda mod, a, o, i=i: seen.__setitem__(i, o.detach()))
               for i, m in enumerate(model)]
    x = torch.randn(2, 5, 8)
    with rec.step(0):
        model(x).square().mean().backward()
    rec.close()
    for h in handles:
        h.remove()
    df = rec.frame()
    for i, block in enumerate(model):
        logits = seen[i].reshape(-1, 3)
        ref = routing_reference(logits, 2)
        torch.testing.assert_close(recorded(df, "moe_load", str(i)), ref["moe_load"])
        torch.testing.assert_close(recorded(df, "router_entropy", str(i)), ref["router_entropy"].reshape(1))
        for e, expert in enumerate(block.experts):
            want = torch.stack([p.grad.double().norm() for p in expert.parameters()]).norm()
            assert math.isclose(recorded(df, "expert_grad_norm", f"{i}.experts.{e}").item(), want.item(), rel_tol=1e-5)


def test_default_quantities_take_no_router_hooks():
    """The default set costs what it cost: no router hooks, no routing rows."""
    model = build("mixtral", layers=1)
    rec = gradscope.Recorder(model)
    x = torch.randint(0, V, (B, T))
    with rec.step(0):
        model(x, labels=x).loss.backward()
    rec.close()
    assert rec._capture.routers is None
    assert not rec.frame()["quantity"].isin(["moe_load", "expert_grad_norm"]).any()


def test_training_is_bit_identical_and_one_host_read_per_step():
    """Recording ``moe`` changes no number of the model's training, and a recorded step reads
    the host at most once more than the same step without the Recorder (transformers'
    ``batched_mm`` experts read none of their own)."""
    from tests.test_recorder_host_syncs import counting

    def train(record: bool):
        model = build("mixtral", layers=2, experts_impl="batched_mm")
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        rec = gradscope.Recorder(model, quantities="moe", optimizer=opt) if record else None
        reads, losses = [], []
        for step in range(3):
            x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(step))
            with counting() as seen:
                with rec.step(step) if rec is not None else contextlib.nullcontext():
                    loss = model(x, labels=x).loss
                    loss.backward()
            reads.append(len(seen))
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        if rec is not None:
            rec.close()
        return [p.detach().clone() for p in model.parameters()], losses, reads

    params, losses, reads = train(True)
    params0, losses0, reads0 = train(False)
    assert all(torch.equal(a, b) for a, b in zip(losses, losses0))
    assert all(torch.equal(a, b) for a, b in zip(params, params0))
    assert all(r - r0 <= 1 for r, r0 in zip(reads, reads0)), (reads, reads0)


class Unreadable(nn.Module):
    """A declared router that returns its logits only and says nothing of its top-k."""

    gradscope_router = True

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 3)

    def forward(self, x):
        return self.proj(x)


def test_an_unreadable_router_warns_and_has_no_rows():
    model = nn.Sequential(nn.LayerNorm(8), Unreadable())
    rec = gradscope.Recorder(model, quantities=["moe_load", "router_z"])
    with pytest.warns(UserWarning, match="router '1'.*neither it nor its MoE layer has a top_k"):
        with rec.step(0):
            model(torch.randn(4, 8)).sum().backward()
    rec.close()
    assert not rec.frame()["quantity"].isin(["moe_load", "router_z"]).any()


def test_a_capacity_router_of_another_form_warns_not_guesses():
    """NLLB-MoE routes top-2 with a capacity and returns its combine weights beside its logits
    (both (..., E) floats): no rows, and a warning, rather than a guess at which is which."""
    cfg = tf.NllbMoeConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=4,
                           expert_capacity=2, encoder_sparse_step=1, decoder_sparse_step=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = tf.NllbMoeForConditionalGeneration(cfg)
    rec = gradscope.Recorder(model, quantities=["moe_load"])
    x = torch.randint(4, V, (B, T))
    with pytest.warns(UserWarning, match="NllbMoeTop2Router.*not Switch Transformers'"):
        with rec.step(0):
            model(input_ids=x, labels=x).loss.backward()
    rec.close()
    assert not (rec.frame()["quantity"] == "moe_load").any()
