"""The two settings a recorded step changes (``DonationOff`` in gradscope/recorder/capture/compile_settings.py:
AOTAutograd's donated buffers off, the compile caches' key tagged) are the user's again when
the last recorded step ends, however it ends; what the user sets inside a step stays."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.compiler.config as compiler_config
from torch import nn

import gradscope
from gradscope.recorder.capture.compile_settings import DonationOff


@pytest.fixture
def user_settings():
    """The user's own settings: donation on, a tag of theirs (the previous ones back after the test)."""
    saved = _settings()
    functorch_config.donated_buffer, compiler_config.cache_key_tag = True, "mine"
    yield True, "mine"
    functorch_config.donated_buffer, compiler_config.cache_key_tag = saved


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))


def _settings() -> tuple[bool, str]:
    return functorch_config.donated_buffer, compiler_config.cache_key_tag


def test_two_overlapping_recorded_steps_give_the_settings_back_when_the_last_ends(user_settings):
    a, b = gradscope.Recorder(_model()), gradscope.Recorder(_model())
    a.begin_step(0)
    assert _settings() == (False, f"mine+{DonationOff.CACHE_TAG}")  # the user's tag kept, ours appended
    b.begin_step(0)
    a.end_step()
    assert _settings() == (False, f"mine+{DonationOff.CACHE_TAG}")  # b's step still records
    b.abort_step()
    assert _settings() == user_settings
    a.close()
    b.close()


def test_an_exception_inside_the_step_gives_the_settings_back(user_settings):
    rec = gradscope.Recorder(_model())
    with pytest.raises(ValueError, match="the user's"):
        with rec.step(0):
            raise ValueError("the user's")
    assert _settings() == user_settings
    rec.close()


def test_a_tag_the_user_sets_inside_the_step_stays(user_settings):
    model = _model()
    rec = gradscope.Recorder(model)
    with rec.step(0):
        compiler_config.cache_key_tag = "changed inside"
        model(torch.randn(2, 4)).sum().backward()
    assert _settings() == (True, "changed inside")
    rec.close()


def test_close_inside_a_step_discards_it_says_so_and_gives_the_settings_back(user_settings):
    model = _model()
    rec = gradscope.Recorder(model)
    with rec.step(0):
        model(torch.randn(2, 4)).sum().backward()
    with pytest.warns(UserWarning, match=r"close\(\) inside step 1: the step is discarded"):
        with rec.step(1):  # (its end, after close(), does nothing more)
            model(torch.randn(2, 4)).sum().backward()
            rec.close()
    assert _settings() == user_settings
    assert rec.frame()["step"].unique().tolist() == [0]
    with pytest.raises(RuntimeError, match="closed"):
        rec.begin_step(2)


def test_a_run_closure_that_closes_the_recorder_returns_its_loss_and_nothing_more_ends(user_settings):
    model = _model()
    rec = gradscope.Recorder(model)

    def closure():
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        rec.close()
        return loss

    with pytest.warns(UserWarning, match=r"close\(\) inside step 0"):
        out = rec.run(0, closure)  # (logs no loss into the closed recorder)
    assert isinstance(out, torch.Tensor) and len(rec.frame()) == 0
    assert _settings() == user_settings
    with pytest.raises(RuntimeError, match=r"no open step \(the recorder is closed\)"):
        rec.end_step()  # only the discarded step's own end passes silently
    with pytest.raises(ValueError, match="the recorder is closed"):
        rec.log("loss", 1.0)
