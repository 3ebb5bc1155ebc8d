"""Spike replay with what a user's own step holds: parameters the optimizer trains outside
the recorded model, buffers a forward replaces, an optimizer stepped inside the closure, and
the watch's calls in the wrong order. The reference is training without any recorder
(``torch.equal``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope

SPIKE_AT = 20
STEPS = 23


class EmaNet(nn.Module):
    """A tiny language model with dropout and a buffer its forward replaces (an EMA of the
    logits' mean, ``self.ema = 0.9 * self.ema + ...``, a new tensor each call)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
        self.register_buffer("ema", torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.block(h)
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean()
        return h


def train(recorded: bool, every: int = 1000, spike_at: int = SPIKE_AT):
    """AdamW over the model and a head outside it (the optimizer trains both); the loss is
    ×1e3 at ``spike_at``. Returns (recorder or None, the model's and the head's state)."""
    torch.manual_seed(0)
    model, head = EmaNet(), nn.Linear(16, 40)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-3)
    rec = gradscope.Recorder(model, optimizer=opt, every=every, on_spike="replay") if recorded else None
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 40, (4, 9), generator=g) for _ in range(STEPS)]
    torch.manual_seed(2)  # dropout
    for step, tokens in enumerate(data, start=1):
        def closure(tokens=tokens, spike=step == spike_at):
            loss = F.cross_entropy(head(model(tokens[:, :-1])).flatten(0, 1), tokens[:, 1:].flatten())
            loss = loss * 1e3 if spike else loss
            loss.backward()
            return loss.detach()
        if rec is None:
            closure()
        else:
            rec.run(step, closure)
        opt.step()
        opt.zero_grad()
    if rec is not None:
        rec.close()
    state = {**{f"model.{k}": v.clone() for k, v in model.state_dict().items()},
             **{f"head.{k}": v.clone() for k, v in head.state_dict().items()}}
    return rec, state


def test_a_replay_leaves_training_as_without_the_recorder_with_a_head_outside_the_model_and_a_replaced_buffer():
    rec, watched = train(True)
    _, plain = train(False)
    assert [r.step for r in rec.watch.flagged] == [SPIKE_AT]
    frame = rec.frame()
    assert set(frame[frame.quantity == "replay"].step) == {SPIKE_AT}  # (replayed: the schedule records no step here)
    assert watched.keys() == plain.keys()
    differ = [k for k in plain if not torch.equal(watched[k], plain[k])]
    assert not differ, differ  # (the head's gradients were doubled by the replay, the EMA kept the replay's update)


def test_the_watch_reads_the_gradient_norm_of_every_parameter_the_optimizer_trains():
    torch.manual_seed(0)
    model, head = EmaNet(), nn.Linear(16, 40)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.0)
    rec = gradscope.Recorder(model, optimizer=opt, every=1000, on_spike="replay")
    tokens = torch.randint(0, 40, (4, 9))

    def closure():
        loss = F.cross_entropy(head(model(tokens[:, :-1])).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach()
    rec.run(1, closure)
    grads = [p.grad for p in [*model.parameters(), *head.parameters()]]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(rec.grad_norm, expected, rtol=1e-6, atol=0)
    rec.close()


def test_a_flagged_step_the_schedule_recorded_has_a_replay_row():
    rec, _ = train(True, every=SPIKE_AT)
    frame = rec.frame()
    flagged = frame[frame.quantity == "replay"]
    assert list(flagged.step) == [SPIKE_AT] and flagged.value.iloc[0] == max(
        z for z in (rec.watch.flagged[0].z_loss, rec.watch.flagged[0].z_grad_norm) if z == z)


def test_a_closure_that_steps_the_optimizer_is_refused_at_its_first_step():
    torch.manual_seed(0)
    model = EmaNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = gradscope.Recorder(model, optimizer=opt, every=1000, on_spike="replay", quantities=["act_norm"])
    tokens = torch.randint(0, 40, (4, 9))

    def closure():
        loss = model(tokens).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    with pytest.raises(RuntimeError, match="closure of step 0 stepped the optimizer"):
        rec.run(0, closure)
    rec.close()


def test_the_watch_called_out_of_order_says_so_at_once():
    torch.manual_seed(0)
    model = EmaNet()
    rec = gradscope.Recorder(model, every=1000, on_spike="replay")
    tokens = torch.randint(0, 40, (4, 9))

    def closure():
        loss = model(tokens).square().mean()
        loss.backward()
        return loss.detach()
    rec.begin_step(1)
    loss = closure()
    with pytest.raises(RuntimeError, match="step 1 is still open; call check_spike after end_step"):
        rec.check_spike(1, loss, closure)
    rec.end_step()
    rec.check_spike(1, loss, closure)
    loss = closure()  # (no begin_step: the RNG states were not taken)
    with pytest.raises(RuntimeError, match="RNG states were not taken"):
        rec.check_spike(2, loss, closure)
    with pytest.raises(TypeError, match=r"got a tensor of shape \(4,\)"):
        rec.run(3, lambda: model(tokens).square().mean(dim=(1, 2)).detach())
    rec.close()
