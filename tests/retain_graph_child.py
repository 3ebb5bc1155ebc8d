"""Child process for tests/test_recorder_compiled_retain_graph.py.

Copy A of a model records a compiled step with one backward; copy B (the same architecture,
so Inductor's FX graph cache serves it A's compiled graphs) records a compiled step with
``backward(retain_graph=True)`` and then ``backward()``. Prints, as JSON, the largest
relative error of B's parameter gradients and of its ``act_grad_norm`` rows against eager
autograd on a third copy, and ``torch._functorch.config.donated_buffer`` and
``torch.compiler.config.cache_key_tag`` inside the step and after it.

With ``stale`` as argument, copy A records as a gradscope without ``DonationOff`` did (its
``take`` and ``give_back`` do nothing then), leaving a donating backward in the cache, as an
older gradscope would have left it for a newer one.
"""

from __future__ import annotations

import copy
import json

import torch
import sys

import torch._functorch.config as functorch_config
import torch.compiler.config as compiler_config
from torch import nn

import gradscope
from gradscope.recorder.capture.compile_settings import DonationOff
from twin_models import TanhBlock


class Net(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([TanhBlock(d), TanhBlock(d)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        return self.head(h).pow(2).mean()


def main(stale: bool) -> None:
    torch.manual_seed(0)
    base, x = Net(), torch.randn(4, 5, 16)
    a, b, plain = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    rec_a = gradscope.Recorder(a)
    take, give_back = DonationOff.take, DonationOff.give_back
    if stale:
        DonationOff.take = DonationOff.give_back = classmethod(lambda cls, held: None)
    with rec_a.step(0):
        torch.compile(a, fullgraph=True)(x).backward()
    rec_a.close()
    DonationOff.take, DonationOff.give_back = take, give_back

    rec_b = gradscope.Recorder(b)  # (the quantities of A: the same graphs, which the cache then serves)
    run = torch.compile(b, fullgraph=True)
    with rec_b.step(0):
        inside = functorch_config.donated_buffer, compiler_config.cache_key_tag
        loss = run(x)
        loss.backward(retain_graph=True)
        loss.backward()
    after = functorch_config.donated_buffer, compiler_config.cache_key_tag
    df = rec_b.frame()
    rec_b.close()

    # the reference: the same two backwards, eagerly, on a plain copy; the gradient at each
    # norm's output is the sum of both backwards' (the step's row is the root of their summed squares)
    outs = []
    hooks = [blk.ln.register_forward_hook(lambda m, i, o: outs.append(o)) for blk in plain.layers]
    grads: dict[int, list[torch.Tensor]] = {}
    ref = plain(x)
    for k, o in enumerate(outs):
        o.register_hook(lambda g, k=k: grads.setdefault(k, []).append(g.detach().clone()))
    ref.backward(retain_graph=True)
    ref.backward()
    for h in hooks:
        h.remove()
    param_err = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(b.parameters(), plain.parameters()))
    got = df[(df.quantity == "act_grad_norm") & (df.micro_step == -1)].set_index("site").value
    site_err = max(abs(got[f"layers.{k}.ln.out"] / sum(g.square().sum() for g in gs).sqrt().item() - 1)
                   for k, gs in grads.items())
    print(json.dumps({"param_err": param_err, "site_err": site_err, "inside": inside, "after": after}))


if __name__ == "__main__":
    main(stale=sys.argv[1:] == ["stale"])
