"""Long runs: a SIGKILL'd run leaves a loadable dataset; memory stays flat over 5,000
recorded steps; the report reads those 5,000 steps in under a minute."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gradscope

HERE = Path(__file__).parent
KEY = ["step", "micro_step", "stack", "layer", "site", "quantity", "layer_j"]


def test_sigkill_mid_run_loses_at_most_flush_every_steps(tmp_path):
    flush_every, kill_at = 5, 23
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    child = subprocess.Popen([sys.executable, str(HERE / "sink_child.py"), str(tmp_path), str(flush_every), "100000"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    printed = []
    try:
        for line in child.stdout:
            printed.append(int(line.split()[1]))
            if printed[-1] == kill_at:
                child.send_signal(signal.SIGKILL)
                break
        rest, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL, err
    started = max(printed + [int(line.split()[1]) for line in rest.split()[1::2]])  # "step N" lines after the kill signal
    df = gradscope.load(tmp_path / "run")
    steps = sorted(df.step.unique())
    assert steps == list(range(len(steps)))  # whole part files, in order, from step 0
    assert not df.duplicated(KEY).any()  # every flushed step exactly once
    assert started - len(steps) <= flush_every  # steps 0 .. started-1 were recorded; at most flush_every lost
    assert len(steps) >= 15 and len(steps) % flush_every == 0
    per_step = df.groupby("step").quantity.value_counts().unstack(fill_value=0)
    assert (per_step.loss == 1).all() and (per_step.act_grad_norm == per_step.act_grad_norm.iloc[0]).all()
    assert (per_step.update_ratio[per_step.index % 3 == 0] > 0).all()  # rows that arrive after the step stay with it


def _rss_mib() -> float:
    """Resident set size after handing freed heap pages back (glibc ``malloc_trim``), so it
    counts what is held, not what the allocator keeps cached."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


STEPS, FLUSH_EVERY, WARMUP = 5000, 100, 500


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """5,000 recorded steps of the ci-size decoder LM streamed to disk; RSS sampled."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux /proc to read RSS")
    out = tmp_path_factory.mktemp("long") / "exp"
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rec = gradscope.Recorder(model, quantities=[*gradscope.recorder.DEFAULT_QUANTITIES, "spike"],
                             log_dir=out, flush_every=FLUSH_EVERY)
    g = torch.Generator().manual_seed(0)
    rss, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(STEPS):
            tokens = torch.randint(3, 64, (4, 8), generator=g)
            with rec.step(step):
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                rec.log("loss", loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step + 1 in (WARMUP, STEPS):
                rss[step + 1] = _rss_mib()
    finally:
        torch.set_num_threads(threads)
        rec.close()
    return out, rss


def test_memory_stays_flat_over_5000_recorded_steps(long_run):
    out, rss = long_run
    df = gradscope.load(out)
    rows_per_step = len(df) / STEPS
    # Bound: what the Recorder holds between flushes is the buffer, flush_every steps of
    # rows at ~20 B each (interned key id + float64 + the step's chunk), ~0.1 MiB here; a
    # flush briefly builds a pandas frame and an arrow table of those rows (13 columns,
    # under 1 MiB). 2 MiB covers both twice over. Keeping the table in memory instead would
    # grow by rows × 20 B, ~5.5 MiB over these steps, so a leak of the table fails the test.
    buffer_mib = FLUSH_EVERY * rows_per_step * 20 / 2**20
    bound = 2.0
    in_memory_mib = (STEPS - WARMUP) * rows_per_step * 20 / 2**20
    assert buffer_mib < bound / 4 and in_memory_mib > 2 * bound  # the bound separates flat from growing
    growth = rss[STEPS] - rss[WARMUP]
    print(f"RSS growth {growth:+.2f} MiB over {STEPS - WARMUP} steps, {rows_per_step:.0f} rows/step")
    assert growth < bound, f"RSS grew {growth:.2f} MiB over {STEPS - WARMUP} steps (bound {bound} MiB; {rows_per_step:.0f} rows/step)"
    assert sorted(df.step.unique()) == list(range(STEPS))


def test_report_reads_5000_steps_in_under_a_minute(long_run, tmp_path):
    from gradscope.__main__ import main

    out, _ = long_run
    t0 = time.perf_counter()
    assert main(["report", str(out), "--out", str(tmp_path)]) == 0
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"report took {elapsed:.1f} s"
    summary = (tmp_path / "summary.md").read_text()
    assert "5000 recorded steps, 0–4999" in summary and "- step 0, decoder: bottom/top" in summary
    assert "- step 4999, decoder" in summary and "every recorded value was finite" in summary
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["exp_heatmap.png", "exp_series.png"]
