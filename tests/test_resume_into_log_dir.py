"""A run checkpointed and resumed into its own ``log_dir`` (a new-user review): the
checkpoint flushes what was recorded, ``frame()`` after the resume equals
``gradscope.load(log_dir)``, and rows a Recorder kept in memory reach a resumed Recorder's
disk. References are the run recorded without interruption, here."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope

KEY = ["step", "micro_step", "site", "quantity", "layer", "layer_j"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _steps(rec, model, opt, steps, x) -> None:
    for step in steps:
        with rec.step(step):
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(KEY).reset_index(drop=True)[KEY + ["value"]]


def _uninterrupted(x) -> pd.DataFrame:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, optimizer=opt)
    _steps(rec, model, opt, range(8), x)
    rec.close()
    return _sorted(rec.frame())


def test_a_checkpoint_keeps_every_step_and_frame_after_resume_equals_load(tmp_path):
    x = torch.randn(4, 8)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, optimizer=opt, log_dir=tmp_path / "run")  # flush_every=100: nothing on disk yet
    _steps(rec, model, opt, range(5), x)
    state = rec.state_dict()  # the checkpoint, with the model's and the optimizer's
    weights, moments = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert list((tmp_path / "run").glob("part-*.parquet")), "the checkpoint did not flush the recorded steps"
    _steps(rec, model, opt, range(5, 6), x)  # recorded after the checkpoint, then the process dies: no close()
    del rec  # (as after a kill: the buffered step 5 is lost)

    model = _model()
    model.load_state_dict(weights)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.load_state_dict(moments)
    resumed = gradscope.Recorder(model, optimizer=opt, log_dir=tmp_path / "run")
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (step 5 is written again: said by a warning)
        _steps(resumed, model, opt, range(5, 8), x)
    frame = _sorted(resumed.frame())
    resumed.flush()  # (load reads the disk; frame also the buffer)
    pd.testing.assert_frame_equal(frame, _sorted(gradscope.load(tmp_path / "run")))
    assert sorted(frame.step.unique()) == list(range(8))
    want = _uninterrupted(x)
    pd.testing.assert_frame_equal(frame, want, rtol=1e-6)
    resumed.close()


def test_rows_kept_in_memory_reach_a_resumed_recorder_s_log_dir(tmp_path):
    x = torch.randn(4, 8)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = gradscope.Recorder(model, optimizer=opt)
    _steps(memory, model, opt, range(4), x)
    state = memory.state_dict()
    memory.close()
    disk = gradscope.Recorder(model, optimizer=opt, log_dir=tmp_path / "run")
    disk.load_state_dict(state)
    _steps(disk, model, opt, range(4, 8), x)
    disk.close()
    pd.testing.assert_frame_equal(_sorted(gradscope.load(tmp_path / "run")), _uninterrupted(x), rtol=1e-6)


def test_the_spike_windows_survive_a_checkpoint(tmp_path):
    """A resumed run judges its first steps against the history it had: the checkpoint
    holds the spike quantity's windows and the replay watch's (saved and loaded with
    ``torch.load(weights_only=True)``)."""
    x = torch.randn(4, 8)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = gradscope.Recorder(model, optimizer=opt, quantities=["act_grad_norm", "param_grad_norm", "spike"],
                             on_spike="replay")
    for step in range(40):
        rec.run(step, lambda: model(x).square().mean().backward() or torch.tensor(1.0 + 0.01 * (step % 3)))
        opt.step()
        opt.zero_grad()
    torch.save(rec.state_dict(), tmp_path / "ckpt.pt")
    resumed = gradscope.Recorder(model, optimizer=opt, quantities=["act_grad_norm", "param_grad_norm", "spike"],
                                 on_spike="replay")
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    for a, b in ((rec._out.spikes, resumed._out.spikes), (rec.watch._rule, resumed.watch._rule)):
        assert a._index == b._index and (a._seen == b._seen).all() and a._seen.max() > 0
        assert ((a._ring == b._ring) | (np.isnan(a._ring) & np.isnan(b._ring))).all()
    spike = lambda: model(x).square().mean().mul(1e3).backward() or torch.tensor(1e3)  # noqa: E731
    assert resumed.run(40, spike) is not None and resumed.watch.last.flagged  # judged against the old history
    rec.close()
    resumed.close()


def test_a_row_logged_later_for_a_flushed_step_adds_to_it(tmp_path):
    """``rec.log("val_loss", v, step=s)`` after step ``s`` was written to disk: ``frame()``
    keeps step ``s``'s other rows, as ``gradscope.load`` does."""
    x = torch.randn(4, 8)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, optimizer=opt, log_dir=tmp_path / "run", flush_every=1)
    _steps(rec, model, opt, range(3), x)  # step 0 is on disk (a part per step)
    before = rec.frame().query("step == 0")
    rec.log("val_loss", 2.5, step=0)
    after = rec.frame().query("step == 0")
    assert set(after.quantity) == set(before.quantity) | {"val_loss"}
    assert len(after) == len(before) + 1
    rec.close()
    pd.testing.assert_frame_equal(_sorted(rec.frame()), _sorted(gradscope.load(tmp_path / "run")))


@pytest.mark.parametrize("flush_every", [10, 2])
def test_a_step_written_twice_is_read_from_its_last_write_in_one_part_or_two(tmp_path, flush_every):
    """A loop that records step 1 twice (and logs a value for step 2 twice): ``gradscope.load``
    and ``rec.frame()`` keep each (step, quantity) from its last write, whether both writes
    went into one part file (``flush_every=10``) or two (``flush_every=2``)."""
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder"))
    rec = gradscope.Recorder(model, log_dir=tmp_path / "run", flush_every=flush_every)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the repeated step is warned of: checked elsewhere)
        for i, step in enumerate([0, 1, 1, 2]):
            tokens = torch.randint(3, 64, (4, 8), generator=g)
            with rec.step(step):
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
                rec.log("myval", 100.0 + i)
            model.zero_grad(set_to_none=True)
        rec.log("val_loss", 1.0, step=2)
        rec.log("val_loss", 2.0, step=2)
        in_frame = rec.frame()
    rec.close()
    loaded = gradscope.load(tmp_path / "run")
    for df in (in_frame, loaded):
        mine = df[df.quantity == "myval"].sort_values("step")
        assert list(zip(mine.step, mine.value)) == [(0, 100.0), (1, 102.0), (2, 103.0)]
        assert df[df.quantity == "val_loss"].value.tolist() == [2.0]
        counts = df[df.quantity != "val_loss"].groupby("step").size()
        assert counts[0] == counts[1] == counts[2], counts.to_dict()
    key = ["step", "micro_step", "stack", "layer", "site", "quantity", "layer_j", "role"]
    pd.testing.assert_frame_equal(in_frame.sort_values(key).reset_index(drop=True),
                                  loaded.sort_values(key).reset_index(drop=True), check_like=True)


@pytest.mark.parametrize("flush_every", [1, 3, 100])
def test_a_resumed_run_replaces_the_abandoned_run_s_steps_whole(tmp_path, flush_every):
    """A run that went wrong after its checkpoint (a ``nonfinite``-like row at step 6) is
    resumed from step 4 into its ``log_dir`` and does not go wrong: what the abandoned run
    wrote of steps 4-7 goes, also the quantity the resumed run never writes; a value the
    resumed run logs for an earlier step it did not record (step 1) adds to that step; and
    ``read`` with few columns keeps the same rows (its last-write key read, then dropped)."""
    x = torch.randn(4, 8)
    log_dir = tmp_path / "run"
    model, opt = _model(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradscope.Recorder(model, optimizer=opt, log_dir=log_dir, flush_every=flush_every)
    _steps(rec, model, opt, range(4), x)
    state = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), rec.state_dict())
    for step in range(4, 8):
        with rec.step(step):
            model(x).square().mean().backward()
            if step == 6:
                rec.log("went_wrong", 1.0)
        opt.step()
        opt.zero_grad()
    rec.close()  # (the abandoned run: its parts stay in log_dir)

    model = _model()
    model.load_state_dict(state[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.load_state_dict(state[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (steps already in log_dir: warned of, checked elsewhere)
        rec = gradscope.Recorder(model, optimizer=opt, log_dir=log_dir, flush_every=flush_every)
        rec.load_state_dict(state[2])
        _steps(rec, model, opt, range(4, 8), x)
        rec.log("val_loss", 3.5, step=1)
        in_frame = rec.frame()
    rec.close()
    loaded = gradscope.load(log_dir)
    reference = _uninterrupted(x)
    for df in (in_frame, loaded):
        assert "went_wrong" not in set(df.quantity)
        assert df[df.quantity == "val_loss"][["step", "value"]].values.tolist() == [[1, 3.5]]
        pd.testing.assert_frame_equal(_sorted(df[df.quantity != "val_loss"]), reference)
    few = gradscope.sinks.parquet.read(log_dir, columns=["step", "value"])
    assert len(few) == len(loaded)
    assert few.groupby("step").size().equals(loaded.groupby("step").size())


def _session(log_dir, steps, *, rank: int = 0, bad_at: int | None = None, checkpoint_in: int | None = None):
    """One Recorder's session over ``steps`` in ``log_dir`` (flush_every 2): a ``bad`` row
    logged at ``bad_at``; a checkpoint (``state_dict``) inside step ``checkpoint_in``."""
    torch.manual_seed(rank)
    model = _model()
    rec = gradscope.Recorder(model, log_dir=log_dir, flush_every=2, options=gradscope.RecorderOptions(rank=rank))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps:
            with rec.step(step):
                model(torch.randn(4, 8)).square().mean().backward()
                if step == bad_at:
                    rec.log("bad", 1.0)
                if step == checkpoint_in:
                    rec.state_dict()
        frame = rec.frame()
    rec.close()
    return frame


def test_sessions_of_several_ranks_a_filter_and_a_checkpoint_inside_a_step_keep_the_right_rows(tmp_path):
    """Two ranks in one log_dir, each resumed at step 3, the resumed rank 0 checkpointing
    inside step 4: every rank keeps steps 0-5 (a session owns the steps of its own rank), the
    abandoned 'bad' row of step 4 goes (also from a read filtered to it, whose parts no longer
    overlap), and rec.frame() agrees with load."""
    log_dir = tmp_path / "run"
    for rank in (0, 1):
        _session(log_dir, range(6), rank=rank, bad_at=4)
    frames = [_session(log_dir, range(3, 6), rank=rank, checkpoint_in=4 if rank == 0 else None) for rank in (0, 1)]
    loaded = gradscope.load(log_dir)
    assert {r: sorted(set(g.step)) for r, g in loaded.groupby("rank")} == {0: list(range(6)), 1: list(range(6))}
    assert "bad" not in set(loaded.quantity)
    import pyarrow.dataset as ds

    assert gradscope.sinks.parquet.read(log_dir, filter=ds.field("quantity") == "bad").empty
    for rank, frame in enumerate(frames):
        assert "bad" not in set(frame.quantity)
        mine = loaded[loaded["rank"] == rank]
        assert len(frame) == len(mine) and sorted(set(frame.step)) == list(range(6))


@pytest.mark.parametrize("resumed_steps", [range(13, 22), range(16, 19)])
def test_a_resumed_run_that_runs_a_replayed_step_unrecorded_owns_it(tmp_path, resumed_steps):
    """The abandoned run replayed a spike at step 17; the resumed run ran step 17 without one
    and without recording it (every=5). The replay's rows are not read back (a new-user review:
    they were, so the table showed a spike the final run never had). ``range(16, 19)`` records
    nothing in the resumed session: its end writes a part of no rows that says what it ran."""
    from gradscope.recorder.replay.replay import ReplayOptions

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 3, 8)
    watch = ReplayOptions(window=16, min_history=8)

    def closure(spike: bool):
        def step():
            loss = model(x).square().mean() * (1e3 if spike else 1.0)
            loss.backward()
            return loss.detach()
        return step

    def run(steps, spike_at):
        rec = gradscope.Recorder(model, every=5, log_dir=tmp_path / "run", flush_every=2, on_spike=watch)
        for step in steps:
            model.zero_grad(set_to_none=True)
            rec.run(step, closure(step == spike_at))
        return rec

    abandoned = run(range(20), spike_at=17)
    assert [r.step for r in abandoned.watch.flagged] == [17]
    abandoned.close()
    assert 17 in set(gradscope.load(tmp_path / "run").step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (step already in log_dir: said, and tested elsewhere)
        resumed = run(resumed_steps, spike_at=None)
        assert 17 not in set(resumed.frame().step)  # (before the end: the step is in this session's buffer of steps)
        resumed.close()
        loaded = gradscope.load(tmp_path / "run")
    assert 17 not in set(loaded.step) and "replay" not in set(loaded.quantity)
    assert 17 not in set(resumed.frame().step)
    assert {0, 5, 10, 15} <= set(loaded.step)  # (the abandoned run's steps before the resume stay)


def test_steps_run_without_rows_wait_for_the_end_and_are_kept_as_ranges(tmp_path):
    """A checkpoint's flush with nothing recorded since the last part writes no part (a review:
    every checkpoint wrote one of no rows); ``close()`` writes the one that says which steps ran,
    its steps kept as [first, last] ranges (a list of every step made parts megabytes)."""
    import json

    import pyarrow.parquet as pq

    from gradscope.table.parquet import BEGUN_KEY

    model = _model()
    x = torch.randn(4, 3, 8)
    rec = gradscope.Recorder(model, every=100, log_dir=tmp_path / "run")
    for step in range(1, 60):
        with rec.step(step):
            model(x).square().mean().backward()
        if step % 10 == 0:
            rec.state_dict()  # (flushes the sink)
    assert not list((tmp_path / "run").glob("*.parquet"))
    rec.close()
    (part,) = (tmp_path / "run").glob("*.parquet")
    table = pq.read_table(part)
    assert table.num_rows == 0 and json.loads(table.schema.metadata[BEGUN_KEY])["ranges"] == [[1, 59]]
    assert gradscope.load(tmp_path / "run").empty
