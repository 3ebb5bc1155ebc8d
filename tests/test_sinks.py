"""Sinks: the parquet dataset (schema, flushing, folders of runs) and the live trackers
(TensorBoard, W&B offline), each read back and compared with the in-memory frame."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

import gradscope
from gradscope.sinks import SCHEMA, ParquetSink, TensorBoardSink, WandbSink, open_dataset, series_name


def _model():
    torch.manual_seed(0)
    return gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder"))


def _train(model, recorders, steps, opt=None):
    """Records ``steps`` steps with every recorder at once (same numbers for all)."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(3, 64, (4, 8), generator=g)
        for rec in recorders:
            rec.begin_step(step)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        for rec in recorders:
            rec.end_step()
            rec.log("loss", loss.item(), step=step)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_parquet_dataset_equals_the_in_memory_frame(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    disk = gradscope.Recorder(model, quantities="all", optimizer=opt, slow_every=2, log_dir=tmp_path / "exp1", flush_every=3)
    memory = gradscope.Recorder(model, quantities="all", optimizer=opt, slow_every=2, run="exp1")
    assert disk.run_name == "exp1"  # run defaults to the log_dir's name
    _train(model, [disk, memory], 7, opt)
    expected = memory.frame()
    assert set(expected.quantity) >= {"act_grad_norm", "update_ratio", "cosine", "loss"}
    pd.testing.assert_frame_equal(disk.frame(), expected)  # mid-run: two part files and the buffer
    parts = sorted((tmp_path / "exp1").iterdir())
    assert [p.name.split("-")[1:4] for p in parts] == [["r0", "0000000000", "0000000002"], ["r0", "0000000003", "0000000005"]]
    disk.close()
    memory.close()
    parts = sorted((tmp_path / "exp1").iterdir())
    assert len(parts) == 3 and all(p.suffix == ".parquet" for p in parts)  # no temporary file left behind
    frame_schema = pa.Schema.from_pandas(expected, preserve_index=False).remove_metadata()
    for part in parts:
        schema = pq.read_schema(part)
        assert schema.remove_metadata() == SCHEMA == frame_schema
        assert schema.metadata[b"gradscope.format"] == b"1"
    loaded = gradscope.load(tmp_path / "exp1")
    pd.testing.assert_frame_equal(loaded, expected)
    assert (loaded.dtypes == expected.dtypes).all()


def test_flush_every_bounds_what_is_held_in_memory(tmp_path):
    model = _model()
    rec = gradscope.Recorder(model, quantities=["act_grad_norm", "loss"], log_dir=tmp_path / "run", flush_every=10)
    sink = rec._out.disk
    held = []
    g = torch.Generator().manual_seed(0)
    for step in range(25):
        with rec.step(step):
            model(torch.randint(3, 64, (2, 6), generator=g)).logsumexp(-1).mean().backward()
        held.append(len(set(sink._buffer.steps())) + sum(kind == "step" for kind, _, _ in rec._late._queue))
    assert max(held) == 10 and not len(rec._store._chunks)  # (waiting + buffered); nothing in the in-memory store
    assert sorted(gradscope.load(tmp_path / "run").step.unique()) == list(range(20))  # steps 20-24 still buffered
    rec.close()
    assert sorted(gradscope.load(tmp_path / "run").step.unique()) == list(range(25))
    with pytest.raises(ValueError, match="flush_every"):
        ParquetSink(tmp_path / "x", flush_every=0)


def test_a_folder_of_runs_loads_as_one_frame(tmp_path):
    model = _model()
    frames = {}
    for name, steps in (("a", 3), ("b", 5)):
        rec = gradscope.Recorder(model, quantities=["act_grad_norm", "loss"], log_dir=tmp_path / "runs" / name, flush_every=2)
        _train(model, [rec], steps)
        rec.close()
        frames[name] = rec.frame()
    gradscope.save_frame(frames["a"].assign(run="saved"), tmp_path / "runs" / "saved.parquet")  # a saved table is read too
    (tmp_path / "runs" / "b" / ".part-r0-x.parquet.tmp").write_bytes(b"PAR1 half a file")  # a write cut short: hidden, skipped
    both = gradscope.load(tmp_path / "runs")
    assert both.groupby("run").size().to_dict() == {"a": len(frames["a"]), "b": len(frames["b"]), "saved": len(frames["a"])}
    pd.testing.assert_frame_equal(both[both.run == "b"].reset_index(drop=True), frames["b"])
    pd.testing.assert_frame_equal(gradscope.load(tmp_path / "runs" / "a"), frames["a"])
    # a larger-than-memory query: filter and projection pushed into the scan
    table = open_dataset(tmp_path / "runs").to_table(columns=["run", "step", "value"], filter=ds.field("quantity") == "loss")
    assert sorted(zip(table["run"].to_pylist(), table["step"].to_pylist())) == \
        sorted(zip(*[both[both.quantity == "loss"][c].tolist() for c in ("run", "step")]))
    pq.write_table(pa.table({"x": [1]}), tmp_path / "runs" / "other.parquet")
    with pytest.raises(ValueError, match="other.parquet.*not a gradscope table"):
        gradscope.load(tmp_path / "runs")
    with pytest.raises(FileNotFoundError):
        gradscope.load(tmp_path / "runs" / "b" / "nothing-here")


def test_runs_in_different_places_under_one_name_are_all_loaded(tmp_path):
    """A sweep laid out as runs/lr0.1/seed0 and runs/lr1.0/seed0 names both runs "seed0", and
    two saved tables keep the default run name: a folder load keeps every row of each (the
    newest write wins only inside one log_dir) and warns that the names clash."""
    model = _model()
    frames = []
    for lr in ("lr0.1", "lr1.0"):
        rec = gradscope.Recorder(model, quantities=["act_grad_norm", "loss"], log_dir=tmp_path / "runs" / lr / "seed0",
                                 flush_every=2)
        _train(model, [rec], 3)
        rec.close()
        frames.append(rec.frame())
        rec.save(tmp_path / "saved" / f"{lr}.parquet")
    for folder in ("runs", "saved"):
        with pytest.warns(UserWarning, match="share a run name"):
            both = gradscope.load(tmp_path / folder)
        assert len(both) == sum(map(len, frames)), folder
        pd.testing.assert_frame_equal(both.sort_values(list(both.columns)).reset_index(drop=True),
                                      pd.concat(frames).sort_values(list(both.columns)).reset_index(drop=True))


def test_tensorboard_sink_reads_back_equal_to_the_frame(tmp_path):
    tbparse = pytest.importorskip("tbparse")
    model = _model()
    rec = gradscope.Recorder(model, quantities="all", slow_every=2, sinks=[TensorBoardSink(tmp_path / "tb")])
    _train(model, [rec], 3)
    rec.close()
    frame = rec.frame()
    scalars = tbparse.SummaryReader(str(tmp_path / "tb")).scalars
    assert len(scalars) == len(frame)
    want = pd.DataFrame({"tag": [series_name(k) for k in _keys(frame)], "step": frame.step, "want": frame.value})
    got = want.merge(scalars, on=["tag", "step"], how="left", validate="one_to_one")
    np.testing.assert_allclose(got.value, got.want.astype(np.float32), rtol=1e-6)  # TensorBoard stores float32
    assert "act_grad_norm/decoder.layers.1.out" in set(scalars.tag) and "cosine/decoder.layers/2_1" in set(scalars.tag)


def _keys(frame):
    opt = lambda c: [None if v is pd.NA else int(v) for v in frame[c].astype(object)]
    return zip(frame.micro_step, frame["stack"], opt("layer"), frame.site, frame.quantity, opt("layer_j"), frame.role)


def _wandb_history_written(run_dir: Path, rows: int, timeout: float = 60.0) -> list[dict]:
    """The history rows of an offline W&B run once ``rows`` of them are in its file: W&B's
    service process writes the file, and on a loaded machine (the suite's other worker
    compiling) ``run.finish()`` has returned before the rows were there."""
    deadline = time.monotonic() + timeout
    history = _wandb_history(run_dir)
    while len(history) < rows and time.monotonic() < deadline:
        time.sleep(0.2)
        history = _wandb_history(run_dir)
    return history


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run, read from its ``.wandb`` file (a LevelDB-style
    log of ``Record`` protobufs in 32 KiB blocks, after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, record = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block padding
            pos += left
            continue
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            r = pb.Record()
            r.ParseFromString(record)
            record = b""
            if r.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def test_wandb_sink_offline_reads_back_equal_to_the_frame(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    model = _model()
    with pytest.raises(RuntimeError, match="wandb.init"):  # no active run when the first step is logged
        with gradscope.Recorder(model, quantities=["act_grad_norm"], sinks=[WandbSink()]) as rec:
            _train(model, [rec], 1)
    run = wandb.init(project="gradscope-test", dir=str(tmp_path), mode="offline", settings=wandb.Settings(console="off"))
    try:
        model = _model()
        rec = gradscope.Recorder(model, quantities="all", slow_every=2, sinks=[WandbSink()])
        _train(model, [rec], 3)
        rec.close()
    finally:
        run.finish()
    frame = rec.frame()
    history = _wandb_history_written(next((tmp_path / "wandb").glob("offline-run-*")), rows=3)
    assert [h["gradscope/step"] for h in history] == [0, 1, 2]  # one row per recorded step, loss included
    assert [h["_step"] for h in history] == [0, 1, 2]  # at the tracker's own step
    got = {(name, h["gradscope/step"]): v for h in history for name, v in h.items() if not name.startswith(("_", "gradscope/"))}
    want = {(name, step): v for name, step, v in zip((series_name(k) for k in _keys(frame)), frame.step, frame.value)}
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-12)
    assert ("act_grad_norm/decoder.layers.0.out", 2) in got and ("loss/total", 2) in got


def test_a_log_dir_that_cannot_be_written_is_refused_when_the_recorder_is_made(tmp_path):
    """Not at the first flush, ``flush_every`` steps into the run: the error names log_dir,
    and the model is left without the recorder's hooks."""
    (tmp_path / "afile").write_text("not a folder")
    model = _model()
    with pytest.raises(NotADirectoryError, match=r"log_dir: cannot write into .*afile/sub"):
        gradscope.Recorder(model, log_dir=tmp_path / "afile" / "sub")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_failed_part_write_names_log_dir_and_keeps_the_rows_for_the_next_flush(tmp_path, monkeypatch):
    """Disk full at a flush: the error names gradscope, log_dir and the steps (pyarrow's raw
    OSError did not), and once writing works again nothing is lost."""
    import errno

    import gradscope.sinks.parquet as parquet

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(3)])
    rec = gradscope.Recorder(model, quantities=["act_grad_norm"], log_dir=tmp_path / "run", flush_every=2)
    real = parquet.write_part

    def full(table, path):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(parquet, "write_part", full)
    with pytest.raises(OSError, match=r"gradscope: writing steps 0-1 to log_dir .*run failed \(No space left"):
        for step in range(3):
            with rec.step(step):
                model(torch.randn(2, 4)).square().sum().backward()
    monkeypatch.setattr(parquet, "write_part", real)
    rec.close()  # (step 2 did not run: opening it raised, at the flush of steps 0-1)
    assert sorted(set(gradscope.load(tmp_path / "run").step)) == [0, 1]
