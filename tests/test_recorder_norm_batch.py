"""The batched reductions behind the recorder's host cost (issue 25): a :class:`NormBatch`
(site values and gradients handed over one at a time) and a :class:`SquaredNormPlan` (a
model's gradients, step after step) give each tensor's ‖t‖² as an fp64 sum computed here
does, whatever the mix of shapes, dtypes and lengths, and a waiting tensor changed in place
raises instead of giving a stale norm."""

from __future__ import annotations

import pytest
import torch

from gradscope.recorder.numerics.squared_norms import DENSE_MIN, RELATIVE_ERROR_BOUND, NormBatch, SquaredNormPlan


def _mixed(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 5, 16), (16,), (64, 16), (2, 5, 16), (), (16, 64), (3,), (DENSE_MIN + 7,), (130, 130), (16,)]
    out = [torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 4, (), generator=g).item() for s in shapes]
    out.append(torch.randn(4, 16, generator=g).to(torch.bfloat16))
    out.append(torch.randn(5, 3, generator=g, dtype=torch.float64))
    return out


def _reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double().square().sum() for t in tensors])


def test_a_plan_gives_every_tensor_its_fp64_squared_norm_in_order():
    tensors = _mixed()
    plan = SquaredNormPlan(tensors)
    got = plan(tensors)
    assert got.dtype == torch.float64 and got.shape == (len(tensors),)
    torch.testing.assert_close(got, _reference(tensors), rtol=RELATIVE_ERROR_BOUND, atol=0)
    again = _mixed(seed=1)  # same shapes, new values: the plan fits and is right again
    assert plan.fits(again)
    torch.testing.assert_close(plan(again), _reference(again), rtol=RELATIVE_ERROR_BOUND, atol=0)
    assert not plan.fits(again[:-1]) and not plan.fits([t.reshape(-1) for t in again])


def test_a_norm_batch_gives_each_slot_its_norm_whatever_order_they_came_in():
    tensors = _mixed()
    batch = NormBatch()
    slots = [7 * k + 3 for k in range(len(tensors))][::-1]
    for slot, t in zip(slots, tensors):
        batch.add(slot, t)
    got_slots, sq = batch.take()
    assert sorted(got_slots) == sorted(slots)
    by_slot = dict(zip(got_slots, sq.tolist()))
    want = _reference(tensors).float()
    for slot, w in zip(slots, want.tolist()):
        assert by_slot[slot] == pytest.approx(w, rel=RELATIVE_ERROR_BOUND)
    assert batch.take() == ([], None)  # taking clears


def test_long_tensors_keep_their_arrival_order_and_pairing_around_short_ones():
    """Long tensors are reduced as they come and stacked once per run at take; short ones
    wait for the batch's reduction. Each (slot, value) pair stays paired, a slot handed over
    twice (a shared module past its calls) keeps both values, and the long ones come out in
    the order they came, as the index writes that consume them expect."""
    g = torch.Generator().manual_seed(3)
    long = [torch.randn(DENSE_MIN + k, generator=g) for k in range(4)]
    short = [torch.randn(2, 5, 16, generator=g) for _ in range(3)]
    batch = NormBatch()
    order = [(5, long[0]), (1, short[0]), (5, long[1]), (2, long[2]), (3, short[1]), (2, short[2]), (9, long[3])]
    for slot, t in order:
        batch.add(slot, t)
    slots, sq = batch.take()
    got = list(zip(slots, sq.tolist()))
    want_long = [(slot, t.double().square().sum().item()) for slot, t in order if t.numel() >= DENSE_MIN]
    want_short = [(slot, t.double().square().sum().item()) for slot, t in order if t.numel() < DENSE_MIN]
    assert [s for s, _ in got] == [s for s, _ in want_long] + [s for s, _ in want_short]
    for (_, value), (_, want) in zip(got, want_long + want_short):
        assert value == pytest.approx(want, rel=RELATIVE_ERROR_BOUND)


def test_a_norm_batch_past_its_limit_reduces_early_and_keeps_everything():
    tensors = [torch.randn(2, 5, 16) for _ in range(30)]
    batch = NormBatch(limit=400)  # a reduction every few tensors
    for k, t in enumerate(tensors):
        batch.add(k, t)
    slots, sq = batch.take()
    assert slots == list(range(30))
    torch.testing.assert_close(sq.double(), _reference(tensors), rtol=RELATIVE_ERROR_BOUND, atol=0)


def test_a_waiting_tensor_modified_in_place_raises_instead_of_a_stale_norm():
    batch = NormBatch()
    a, b = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    batch.add(0, a)
    batch.add(1, b)
    b.mul_(2.0)  # after it was handed over, before its norm was taken
    with pytest.raises(RuntimeError, match="modified in place.*site_outputs_never_modified_in_place"):
        batch.take()
    batch.add(0, a)  # the batch is usable again afterwards
    slots, sq = batch.take()
    assert slots == [0] and sq.item() == pytest.approx(a.double().square().sum().item(), rel=RELATIVE_ERROR_BOUND)
