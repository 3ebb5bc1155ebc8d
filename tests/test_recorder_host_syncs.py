"""A recorded step reaches the host once; an unrecorded step never (issue 25).

Every way a tensor's values can reach Python is counted while steps run: the dispatcher's
``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``) and device-to-host
copies, seen by a ``TorchDispatchMode``, and ``Tensor.numpy()`` / ``Tensor.tolist()``,
which read a CPU tensor's memory without dispatching (the wrapper counts them). On this CPU
every tensor is a host tensor, so the count is the strictest one: a read of any tensor,
the model's or the recorder's own, counts.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradscope
from tests.zoo_cases import batch, loss_of, tiny


class CountHostReads(TorchDispatchMode):
    """Counts the ops that hand a tensor's values to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append("item")
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src, dst = args[0], kwargs.get("device") or (args[1].device if len(args) > 1 and func is torch.ops.aten.copy_.default else None)
            if dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu":
                self.reads.append("to_host")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting():
    """Counts host reads (dispatched, and ``numpy()`` / ``tolist()``) inside the block."""
    mode = CountHostReads()
    numpy, tolist = torch.Tensor.numpy, torch.Tensor.tolist

    def counted_numpy(self, *a, **k):
        mode.reads.append("numpy")
        return numpy(self, *a, **k)

    def counted_tolist(self):
        mode.reads.append("tolist")
        return tolist(self)

    torch.Tensor.numpy, torch.Tensor.tolist = counted_numpy, counted_tolist
    try:
        with mode:
            yield mode.reads
    finally:
        torch.Tensor.numpy, torch.Tensor.tolist = numpy, tolist


def _loss(model, data):
    return loss_of(model(*data), model.config)


@pytest.mark.parametrize("quantities", ["default", "all"])
def test_one_host_read_per_recorded_step_and_none_otherwise(quantities):
    model = gradscope.build_model(tiny("pre_ln"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batch(model.config)
    rec = gradscope.Recorder(model, quantities=quantities, every=2, optimizer=opt)
    per_step = {}
    for step in range(8):
        with counting() as reads:
            with rec.step(step):
                loss = _loss(model, data)
                loss.backward()
                rec.log("loss", loss)
        per_step[step] = list(reads)
        opt.step()
        opt.zero_grad()
    assert all(per_step[s] == [] for s in (1, 3, 5, 7)), per_step  # not recorded: nothing read
    assert all(len(per_step[s]) <= 1 for s in (0, 2, 4, 6)), per_step  # recorded: at most one transfer
    assert rec.frame().step.unique().tolist() == [0, 2, 4, 6]
    rec.close()


def test_the_counter_sees_reads():
    """The count can fail: ``.item()``, ``.tolist()`` and ``.numpy()`` each count."""
    t = torch.ones(3)
    with counting() as reads:
        t.sum().item()
        t.tolist()
        t.numpy()
    assert reads == ["item", "tolist", "numpy"]
