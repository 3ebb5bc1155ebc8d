"""Bad arguments and failed writes, as a new-user review met them: each gives a clear error
that names the argument (no silent no-op, no bare float() or % error), and a failed write
leaves no step open. Values are checked against p.grad computed here."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from torch import nn

import gradscope
from gradscope.sinks import TensorBoardSink


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sites": []}, ValueError, "sites: an empty list"),
    ({"quantities": []}, ValueError, "quantities: an empty list"),
    ({"optimizer": "adam"}, TypeError, "optimizer: "),
    ({"run": 123}, TypeError, "run: "),
    ({"log_dir": ""}, ValueError, "log_dir: an empty path"),
    ({"log_dir": "x", "flush_every": True}, ValueError, "flush_every"),
    ({"every": 1.5}, ValueError, "every: must be an integer"),
    ({"every": True}, ValueError, "every: must be an integer"),
])
def test_bad_constructor_arguments_name_themselves(kwargs, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        gradscope.Recorder(_model(), **kwargs)
    assert not any(tmp_path.iterdir())  # nothing written


def test_numpy_integers_and_a_single_sink_are_taken(tmp_path):
    model = _model()
    rec = gradscope.Recorder(model, every=np.int64(2), sinks=TensorBoardSink(tmp_path / "tb"))
    for step in map(np.int64, range(3)):
        with rec.step(step):
            model(torch.randn(2, 4)).square().sum().backward()
            rec.log("loss", np.float32(0.5))
            rec.log("val_loss", np.array(1.5))  # a 0-d numpy array: float() takes it
        model.zero_grad()
    rec.close()
    assert sorted(rec.frame().step.unique()) == [0, 2]
    assert rec.frame().query("quantity == 'val_loss'").value.tolist() == [1.5, 1.5]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        gradscope.Recorder(None)


@pytest.mark.parametrize("step", [1.5, "3", None, True])
def test_a_step_that_is_no_integer_raises_and_leaves_nothing_open(step):
    model = _model()
    rec = gradscope.Recorder(model)
    with pytest.raises(TypeError, match="the step must be an integer"):
        with rec.step(step):
            pass
    with rec.step(0):  # nothing was left open
        model(torch.randn(2, 4)).sum().backward()
    assert not rec.frame().empty


@pytest.mark.parametrize("step", [-1, np.int64(-5)])
def test_a_negative_step_is_refused_and_leaves_nothing_open(step):
    model = _model()
    rec = gradscope.Recorder(model)
    with pytest.raises(ValueError, match=r"Recorder.step: the step must be >= 0 .*got -"):
        with rec.step(step):
            pass
    with pytest.raises(ValueError, match=r"Recorder.log\(step=...\): the step must be >= 0"):
        rec.log("val_loss", 1.0, step=step)
    with rec.step(0):  # nothing was left open
        model(torch.randn(2, 4)).sum().backward()
    rec.log("val_loss", 1.0, step=3)
    assert sorted(rec.frame().step.unique()) == [0, 3]


def test_log_refuses_names_the_recorder_computes_and_values_that_are_no_numbers():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, optimizer=opt)
    for name, value, error, match in (("lr", 0.5, ValueError, "from the optimizer"),
                                      ("param_grad_norm", 1.0, ValueError, "computes itself"),
                                      ("act_grad_norm", 1.0, ValueError, "computes itself"),
                                      ("", 1.0, ValueError, "non-empty name"),
                                      ("loss", None, TypeError, "'loss'.*NoneType"),
                                      ("loss", "abc", TypeError, "'loss'.*str")):
        with pytest.raises(error, match=match):
            with rec.step(0):
                model(torch.randn(2, 4)).sum().backward()
                rec.log(name, value)
    with rec.step(1):
        model(torch.randn(2, 4)).sum().backward()
        rec.log("loss", 2.0)
    frame = rec.frame()
    assert frame[frame.quantity == "lr"].value.tolist() == [0.1]  # one lr row, the optimizer's
    assert frame[frame.quantity == "loss"].value.tolist() == [2.0]
    without = gradscope.Recorder(model)  # no optimizer: the loop logs lr itself
    with without.step(0):
        model(torch.randn(2, 4)).sum().backward()
        without.log("lr", 0.5)
    assert without.frame().query("quantity == 'lr'").value.tolist() == [0.5]


def test_a_part_write_that_fails_leaves_no_step_open(tmp_path):
    """The disk fills (here: log_dir replaced by a file) when a step starts and a part is
    due: that step raises the write's error, the next steps record once the folder is back,
    and every recorded step reaches the disk, with p.grad's norms."""
    model = _model()
    log_dir = tmp_path / "run"
    rec = gradscope.Recorder(model, quantities=["param_grad_norm"], log_dir=log_dir, flush_every=2)
    want = {}

    def step(i):
        with rec.step(i):
            model(torch.randn(2, 4) * (i + 1)).square().sum().backward()
        want[i] = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        model.zero_grad()

    step(0)
    step(1)
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.write_text("not a folder")
    with pytest.raises(OSError):
        step(2)  # the part of steps 0-1 is due
    log_dir.unlink()
    for i in (3, 4, 5):
        step(i)
    rec.close()
    loaded = gradscope.load(log_dir)
    total = loaded[(loaded.quantity == "param_grad_norm") & (loaded.site == "")].set_index("step").value
    assert sorted(total.index) == [0, 1, 3, 4, 5]
    for i in total.index:
        assert total[i] == pytest.approx(want[i], rel=1e-6)


def test_warnings_point_at_the_users_line():
    """Rows are built later (at frame(), or every few steps), inside gradscope: a warning from
    there names the user's file, not gradscope's."""
    import warnings

    model = _model()
    rec = gradscope.Recorder(model, quantities=["update_ratio", "act_grad_norm"], every=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(4):  # the first steps are built at once, the later ones at frame()
            with rec.step(step):
                model(torch.randn(2, 4)).sum().backward()
        rec.frame()
    ours = [w for w in said if str(w.message).startswith("gradscope")]
    assert len(ours) >= 2 and all(w.filename == __file__ for w in ours), [(w.filename, str(w.message)[:60]) for w in ours]
    rec.close()
