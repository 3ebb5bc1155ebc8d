"""Writes the notebooks and executes them in place (outputs kept), with nbclient.

    python notebooks/build.py            # default preset, as committed
    GRADSCOPE_PRESET=ci python notebooks/build.py --no-save   # what CI checks

Each notebook reads ``GRADSCOPE_PRESET`` (``ci`` or ``default``) to pick its sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent

SETUP = '''import os
import matplotlib.pyplot as plt
import torch
import gradscope
from gradscope import plots

PRESET = os.environ.get("GRADSCOPE_PRESET", "default")  # "ci" in CI: smaller and faster
assert PRESET in ("ci", "default"), PRESET
torch.manual_seed(0)'''

NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "01_quickstart": [
        ("md", "# gradscope quickstart\nRecord per-layer gradient norms of any model in a few lines, as one tidy table, and plot them."),
        ("code", SETUP),
        ("md", "## A zoo model and one recorded step\n`gradscope.snapshot` runs one forward/backward with every hook on and returns the table ([docs/table.md](../docs/table.md))."),
        ("code", '''depth = 4 if PRESET == "ci" else 12
config = gradscope.presets.tiny(variant="post_ln", n_enc=depth, n_dec=depth, vocab=64)
model = gradscope.build_model(config)
src = torch.randint(3, 64, (8, 12)); tgt = torch.randint(3, 64, (8, 11))
loss_fn = lambda logits: torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
df = gradscope.snapshot(model, (src, tgt), loss_fn)
df.head()'''),
        ("code", '''df.quantity.value_counts()'''),
        ("md", "## Plot: gradient norm at each layer output\nIn Post-LN the decoder's gradient shrinks toward the bottom layers (Takase 2022, Fig. 3)."),
        ("code", '''fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
plots.layer_norms(df, stack="encoder", ax=axes[0], title=f"preset {PRESET}, step 0")
plots.layer_norms(df, stack="decoder", ax=axes[1], title=f"preset {PRESET}, step 0")
fig.tight_layout()'''),
        ("md", "## Recording while training\nThe recorder wraps forward and backward of each step; `rec.frame()` gives the table."),
        ("code", '''from gradscope.train import TrainConfig, make_task, train
task = make_task("reverse", vocab=64, max_len=12)
model = gradscope.build_model(config.replace(variant="pre_ln"))
rec = gradscope.Recorder(model, every=5, run="quickstart")
result = train(model, task, TrainConfig(steps=20 if PRESET == "ci" else 100, batch_size=16, lr=1e-3, warmup=10,
                                         eval_every=0, device="cpu"), recorder=rec, progress=False)
table = rec.frame()
table[table.quantity == "param_grad_norm"].query("site == ''")[["step", "value"]]'''),
        ("code", '''ax = plots.loss_curves(result.history, title=f"preset {PRESET}")'''),
    ],
    "02_post_pre_b2t": [
        ("md", "# Post-LN, Pre-LN and B2T side by side\nTakase et al. (2022): Post-LN's LayerNorms shrink the gradient on the way down the decoder; Pre-LN does not; the bottom-to-top (B2T) connection adds the layer input to the last LN input and mitigates it."),
        ("code", SETUP),
        ("code", '''depth = 6 if PRESET == "ci" else 18
frames = []
for variant in ("post_ln", "pre_ln", "b2t"):
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant=variant, n_enc=depth, n_dec=depth, vocab=64, d_model=64, d_ff=128))
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, 64, (16, 12), generator=g), torch.randint(3, 64, (16, 12), generator=g)
    loss_fn = lambda logits: torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
    frames.append(gradscope.snapshot(model, (src, tgt[:, :-1]), loss_fn, run=variant))
import pandas as pd
df = pd.concat(frames, ignore_index=True)'''),
        ("code", '''fig, axes = plt.subplots(1, 2, figsize=(11, 4))
plots.layer_norms(df, stack="encoder", ax=axes[0], title=f"{depth}L-{depth}L, preset {PRESET}, at init")
plots.layer_norms(df, stack="decoder", ax=axes[1], title=f"{depth}L-{depth}L, preset {PRESET}, at init")
fig.tight_layout()'''),
        ("md", "## Where the gradient drops: Takase's locations (1)–(5) in Post-LN decoder layers"),
        ("code", '''ax = plots.location_norms(df[df.variant == "post_ln"], title=f"post_ln {depth}L-{depth}L, preset {PRESET}, at init")'''),
        ("md", "## LayerNorm gains: ‖grad in‖/‖grad out‖ through each norm (below 1 = the norm shrinks the gradient)"),
        ("code", '''gains = df[df.quantity == "ln_gain"].pivot_table(index="variant", values="value", aggfunc=["min", "median", "max"])
gains'''),
    ],
    "03_huggingface": [
        ("md", "# HuggingFace models, built from config\nThe recorder finds the repeated blocks and every norm of any `nn.Module`; no edit to the model. Weights are random (built from the config class; nothing is downloaded)."),
        ("code", SETUP),
        ("code", '''import transformers
n = 4 if PRESET == "ci" else 12
gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=n, n_embd=64, n_head=4, vocab_size=100, n_positions=64,
                                                           bos_token_id=0, eos_token_id=0))
ids = torch.randint(1, 100, (4, 32))
with gradscope.record(gpt2) as rec:
    gpt2(input_ids=ids, labels=ids).loss.backward()
print(rec.site_names[:6], "...", len(rec.site_names), "sites")
gdf = rec.frame()'''),
        ("code", '''ax = plots.layer_norms(gdf, stack="transformer.h", hue="variant", title=f"GPT-2 from config, {n} blocks, preset {PRESET}")'''),
        ("code", '''gdf[gdf.quantity == "ln_gain"][["site", "value"]].head(8)'''),
        ("md", "## T5 (encoder–decoder, RMS-style T5LayerNorm)"),
        ("code", '''t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(num_layers=n, num_decoder_layers=n, d_model=64, d_ff=128,
                                                                    d_kv=16, num_heads=4, vocab_size=100, decoder_start_token_id=0, pad_token_id=0))
with gradscope.record(t5) as rec:
    t5(input_ids=ids, labels=ids[:, :8].contiguous()).loss.backward()
tdf = rec.frame()
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
plots.layer_norms(tdf, stack="encoder.block", ax=axes[0], title="T5 encoder blocks")
plots.layer_norms(tdf, stack="decoder.block", ax=axes[1], title="T5 decoder blocks")
fig.tight_layout()'''),
        ("md", "The same from the command line: `python -m gradscope scan --hf gpt2 --n-layer 48`."),
    ],
    "04_dlcl_training": [
        ("md", "# Watching DLCL weights move\nWang et al. (2019): a dynamic linear combination of layers learns which earlier layers each layer reads. We train `dlcl_pre` and record its weight matrix W."),
        ("code", SETUP),
        ("code", '''from gradscope.train import TrainConfig, make_task, train
depth = 4 if PRESET == "ci" else 8
steps = 40 if PRESET == "ci" else 300
task = make_task("reverse", vocab=64, max_len=12)
model = gradscope.build_model(gradscope.presets.tiny(variant="dlcl_pre", n_enc=depth, n_dec=depth, vocab=64, d_model=64, d_ff=128))
rec = gradscope.Recorder(model, quantities=["dlcl_weight", "loss"], every=steps // 4, run="dlcl")
result = train(model, task, TrainConfig(steps=steps, batch_size=32, lr=2e-3, warmup=20, eval_every=0, device="cpu"),
               recorder=rec, progress=False)
df = rec.frame()
sorted(df.step.unique())'''),
        ("code", '''recorded = sorted(df[df.quantity == "dlcl_weight"].step.unique())
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
plots.dlcl_heatmap(df, stack="encoder", step=int(recorded[0]), ax=axes[0], title=f"encoder W, step {recorded[0]}, preset {PRESET}")
plots.dlcl_heatmap(df, stack="encoder", step=int(recorded[-1]), ax=axes[1], title=f"encoder W, step {recorded[-1]}, preset {PRESET}")
fig.tight_layout()'''),
        ("code", '''ax = plots.dlcl_column(df, column=1, stack="encoder", step=[int(s) for s in recorded], title=f"how much later layers read y_1, preset {PRESET}")'''),
        ("code", '''ax = plots.loss_curves(result.history, title=f"dlcl_pre {depth}L-{depth}L, preset {PRESET}")'''),
    ],
    "05_long_run": [
        ("md", "# A long run, streamed to disk\nLeave the recorder on for a whole run: with `log_dir=` every `flush_every` recorded steps become one parquet part file (written atomically), so memory stays flat and a killed run loses at most `flush_every` steps. We train two zoo decoder LMs, read them back as one table, query one without loading it, and draw the run over time."),
        ("code", SETUP),
        ("code", '''import tempfile
from pathlib import Path
from gradscope.train import TrainConfig, make_task, train
steps, depth = (150, 3) if PRESET == "ci" else (2000, 6)
runs = Path(tempfile.mkdtemp(prefix="gradscope_05_"))
task = make_task("markov_lm", vocab=64, max_len=24)
for variant in ("post_ln", "pre_ln"):
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant=variant, arch="decoder", n_dec=depth, vocab=64, d_model=64, d_ff=128))
    rec = gradscope.Recorder(model, quantities=[*gradscope.recorder.DEFAULT_QUANTITIES, "spike"],
                             log_dir=runs / variant, flush_every=100)   # the run column is the folder name
    train(model, task, TrainConfig(steps=steps, batch_size=16, lr=3e-3, warmup=50, eval_every=0, device="cpu"),
          recorder=rec, progress=False, run=variant)
    rec.close()                                       # flushes the last part
sorted(p.name for p in (runs / "post_ln").iterdir())[:3]'''),
        ("md", "## Read back: one run, or a folder of runs as one table"),
        ("code", '''df = gradscope.load(runs)          # every part below runs/, the run column tells them apart
df.groupby("run").agg(rows=("value", "size"), first_step=("step", "min"), last_step=("step", "max"))'''),
        ("md", "## A run larger than memory: query it with pyarrow datasets\nFilters and column choices are applied while scanning, part by part; only the matching rows are read."),
        ("code", '''import pyarrow.dataset as ds
from gradscope.sinks import open_dataset
table = open_dataset(runs).to_table(columns=["run", "step", "layer", "value"],
                                    filter=(ds.field("quantity") == "act_grad_norm") & (ds.field("role") == "layer_out"))
table.to_pandas().groupby(["run", "layer"]).value.median().unstack("run")'''),
        ("md", "## The run over time\nA layer × step heatmap of the layer-output gradient norm (log colour; non-finite origins would be starred), and the bottom, middle and top layer with spikes marked (a value whose log is more than 6 robust σ above the median of the logs of the site's previous 128 values: median/MAD, so an early transient does not blind it; docs/long-runs.md)."),
        ("code", '''from gradscope.plots.over_time import layer_heatmap, layer_series
fig, axes = plt.subplots(2, 1, figsize=(10, 8))
for ax, variant in zip(axes, ("post_ln", "pre_ln")):
    layer_heatmap(df[df.run == variant], ax=ax, title=f"{variant} {depth}-layer decoder LM, preset {PRESET}")
fig.tight_layout()'''),
        ("code", '''ax = layer_series(df[df.run == "post_ln"], title=f"post_ln {depth}-layer decoder LM, preset {PRESET}")'''),
        ("md", "## The report\n`python -m gradscope report RUN_DIR --out DIR` writes these figures as PNGs and a short summary: vanishing or exploding stacks at the first and last step (the scan's rule), spikes grouped by step, the steps the rule could not judge, the first non-finite site, and MoE and outlier panels when the run recorded those sets."),
        ("code", '''from IPython.display import Markdown
from gradscope.report import report
summary = report(runs / "post_ln", runs / "report", progress=False)
Markdown(summary.read_text().split("### Figures")[0])'''),
        ("md", "## Live trackers\nThe same rows can go to TensorBoard and Weights & Biases while the run goes on (not run here):\n\n```python\nfrom gradscope.sinks import TensorBoardSink, WandbSink\nwandb.init(project=\"deep-postln\")\nrec = gradscope.Recorder(model, log_dir=\"runs/exp1\", sinks=[TensorBoardSink(\"runs/tb\"), WandbSink()])\n```\n\nSeries are named `act_grad_norm/decoder.layers.3.out`, grouped by quantity."),
    ],
    "06_spike_replay": [
        ("md", "# Replay a spike\nWatch every step cheaply; when one spikes, record that very step, per layer, before the optimizer applies it. `Recorder(..., every=25, on_spike=\"replay\")` with `rec.run(step, closure)`: the closure runs forward and backward of the whole step and returns the loss. The watch checks the loss and the total gradient norm (6 robust σ on log values, median/MAD, after 16 steps of history); on a flagged step the schedule skips, the RNG states are restored and the closure runs again, recorded, and the gradients are left as the first run made them."),
        ("code", SETUP),
        ("md", "## A Pre-LN decoder LM with a planted spike\nAt one step the loss is multiplied by 1000 before backward. The closure captures its batch (a loop that refills its batch tensors in place must hand it a copy); clipping reuses the watch's norm."),
        ("code", '''from gradscope.train import make_task, label_smoothed_loss
steps, planted, depth = (40, 33, 2) if PRESET == "ci" else (200, 163, 6)
task = make_task("markov_lm", vocab=32, max_len=12)
torch.manual_seed(0)
model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder", n_dec=depth, vocab=32, d_model=64,
                                                     d_ff=256, dropout=0.1, max_len=12))
opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
rec = gradscope.Recorder(model, optimizer=opt, every=25, on_spike="replay", run="watched")
watch = []
for step in range(1, steps + 1):
    batch = task.batch("train", step, 32)
    def train_step(batch=batch, step=step):
        logits = model(*task.model_inputs(batch))
        loss = label_smoothed_loss(logits, task.targets(batch), pad_id=task.pad_id)
        loss = loss * 1e3 if step == planted else loss       # the planted spike
        loss.backward()
        return loss
    loss = rec.run(step, train_step)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, rec.grad_norm)
    opt.step(); opt.zero_grad()
    r = rec.watch.last
    watch.append({"step": step, "loss": r.loss, "grad_norm": r.grad_norm, "flagged": r.flagged})
rec.close()
rec.watch.flagged'''),
        ("md", "## What the table holds\nThe scheduled steps (every 25th), and the replayed one: its full rows and one `replay` row whose value is the watch's z-score."),
        ("code", '''df = rec.frame()
df.groupby("step").size().rename("rows")'''),
        ("code", '''df[df.quantity.isin(["replay", "loss"]) & (df.step == planted)][["step", "quantity", "site", "value"]]'''),
        ("md", "## Where the gradient jumped\nThe watch's two series, then the layer-output gradient norms of the replayed step against the steps recorded before and after it. A loss multiplied by 1000 scales every gradient by about 1000; a real spike would show which layers moved."),
        ("code", '''import pandas as pd
recorded = sorted(set(df.step) - {planted})
neighbours = [max(s for s in recorded if s < planted), min((s for s in recorded if s > planted), default=max(recorded))]
fig, axes = plt.subplots(1, 3, figsize=(16, 4))
plots.spike_watch(pd.DataFrame(watch), ax=axes[0], title=f"preset {PRESET}")
plots.replay_profile(df, step=planted, neighbours=neighbours, ax=axes[1], title=f"preset {PRESET}")
plots.replay_profile(df, step=planted, neighbours=neighbours, ratio=True, ax=axes[2], title=f"preset {PRESET}")
fig.tight_layout()'''),
        ("md", "## In Lightning and the built-in loop\n`GradscopeCallback(on_spike=\"replay\", every=100)` watches every optimizer step and replays a spiking one from the batches it kept (gradient accumulation included); `gradscope.train.train(model, task, config, recorder=rec)` uses `rec.run` itself. See `docs/spike-replay.md`."),
    ],
    "07_moe_routing": [
        ("md", "# MoE routing: a healthy run beside one whose routing collapses\n`quantities=\"moe\"` adds, per MoE layer and recorded step, the expert load, its imbalance, the router's entropy and z, the top-k mass (and, with a capacity, the dropped share), and per expert the gradient and weight norms, fused 3-D expert tensors sliced along the expert dimension (docs/moe.md). Routers are found on their own (HF `*TopKRouter`, a `gate` beside `experts`, or `gradscope_router = True` on your own)."),
        ("code", SETUP),
        ("md", "## Two tiny Mixtrals, one loop\nThe same seed, weights and batches; only the coefficient of Mixtral's load-balancing loss differs: +0.1 keeps the load even, −0.1 (the same loss with its sign flipped) rewards concentration and makes the routing collapse within a few dozen steps, a stand-in for the slow rich-get-richer drift of a long unbalanced run."),
        ("code", '''import pandas as pd
import transformers as tf
from gradscope.train import make_task

steps, depth = (40, 2) if PRESET == "ci" else (200, 4)
task = make_task("markov_lm", vocab=32, max_len=12)

def train_mixtral(run, aux):
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=depth,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=64, router_aux_loss_coef=aux, output_router_logits=True)
    model = tf.MixtralForCausalLM(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    rec = gradscope.Recorder(model, optimizer=opt, quantities="moe", every=5, run=run)
    for step in range(steps):
        inputs, targets = task.batch("train", step, 32)
        with rec.step(step):
            out = model(inputs)
            lm = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=task.pad_id)
            (lm + aux * out.aux_loss).backward()
            rec.log("loss", lm)
        opt.step(); opt.zero_grad()
    rec.close()
    return model, rec.frame()

healthy_model, healthy = train_mixtral("healthy", 0.1)
collapsed_model, collapsed = train_mixtral("collapsing", -0.1)
df = pd.concat([healthy, collapsed])
df[df.quantity.str.startswith(("moe", "router", "expert"))].groupby("quantity").size().rename("rows")'''),
        ("md", "## Expert load per layer over steps\nEach column is one recorded step, each row an expert's share of the layer's token→expert assignments (1/8 is even; 1/2 is the most one expert can take with top-2)."),
        ("code", '''fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
for ax, run in zip(axes, ["healthy", "collapsing"]):
    plots.expert_load(df, run=run, vmax=0.5, ax=ax, title=f"{run}, preset {PRESET}")
fig.tight_layout()'''),
        ("code", '''fig, axes = plt.subplots(1, 3, figsize=(16, 3.8))
for ax, q in zip(axes, ["moe_imbalance", "router_entropy", "router_z"]):
    plots.routing_series(df, quantity=q, ax=ax, title=f"preset {PRESET}")
fig.tight_layout()'''),
        ("md", "## Per expert\nIn the collapsed run the experts the router stopped choosing get no gradient: their `expert_grad_norm` falls to zero, and their weights (`expert_param_norm`) move only by what Adam's momentum still carries."),
        ("code", '''last = df.step.max()
per_expert = df[(df.step == last) & df.quantity.isin(["expert_grad_norm", "expert_param_norm"]) & (df.layer == 1)]
per_expert.pivot_table(index="layer_j", columns=["quantity", "run"], values="value").round(4)'''),
        ("md", "## Checked against the model's own router logits\nOne more step of the healthy model with `output_router_logits=True`: the load computed here from the logits' top-2 is the recorded `moe_load`."),
        ("code", '''inputs, targets = task.batch("train", steps, 32)
rec = gradscope.Recorder(healthy_model, quantities=["moe_load"])
with rec.step(0):
    out = healthy_model(inputs, output_router_logits=True)
rec.close()
logits = out.router_logits[0]
counts = torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=8).double()
check = rec.frame().query("site == 'model.layers.0.mlp'").sort_values("layer_j")
pd.DataFrame({"recorded": check.value.to_numpy(), "from the logits": (counts / counts.sum()).numpy()})'''),
    ],
}


def make(name: str) -> nbformat.NotebookNode:
    """Builds one notebook from its cell list."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src) for kind, src in NOTEBOOKS[name]]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    """Runs every cell top to bottom; a failing cell raises ``nbclient.exceptions.CellExecutionError``."""
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=sorted(NOTEBOOKS), help="notebooks to build (default: all)")
    parser.add_argument("--no-save", action="store_true", help="execute without writing the .ipynb files")
    args = parser.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for name in args.names:
        t0 = time.perf_counter()
        nb = execute(make(name))
        if not args.no_save:
            nbformat.write(nb, HERE / f"{name}.ipynb")
        print(f"{name}: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
