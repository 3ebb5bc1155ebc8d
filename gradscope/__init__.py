"""gradscope: gradient, LayerNorm and residual diagnostics for deep Transformers.

Public names:
    ModelConfig, build_model, VARIANTS, INITS, admin_init, presets — the model zoo.
    site_names — the sites the recorder probes in a model (zoo or any nn.Module).
    Recorder, record, snapshot — the recorder; RecorderOptions — its less common settings.
    Quantity, StepContext — write a quantity of your own; Key — a row's key (``ctx.add``);
    COMBINE, RANK_RULES — how a quantity's micro-steps and ranks combine.
    QUANTITIES, DEFAULT_QUANTITIES — the built-in quantities, and those recorded by default.
    ReplayOptions — the spike watch's rule (``Recorder(on_spike=...)``); find_spikes — the
    spike rule on a saved table.
    compile_audit — one batch eager and compiled, compared site by site (docs/compile.md).
    load, save_frame — parquet I/O. COLUMNS — the tidy table's columns (docs/table.md).

Every name the docs' examples use is one of these or in a public subpackage
(``gradscope.plots``, ``gradscope.sinks``, ``gradscope.integrations.*``,
``gradscope.distributed``, ``gradscope.train``, ``gradscope.presets``): tests/test_docs_names.py.
"""

from gradscope import presets
from gradscope.config import ModelConfig
from gradscope.models import INITS, VARIANTS, Site, SiteNorm, admin_init, build_model
from gradscope.io import load, save_frame
from gradscope.recorder import Recorder, RecorderOptions, record, snapshot
from gradscope.recorder.quantities.combine import COMBINE
from gradscope.recorder.quantities.context import StepContext
from gradscope.recorder.quantities.registry import DEFAULT_QUANTITIES
from gradscope.recorder.quantities.registry import QUANTITY_NAMES as QUANTITIES
from gradscope.recorder.quantities.quantity import RANK_RULES, Quantity
from gradscope.recorder.quantities.spike import find_spikes
from gradscope.recorder.replay.replay import ReplayOptions
from gradscope.recorder.discovery.layout import site_names
from gradscope.table import COLUMNS
from gradscope.table.keys import Key
from gradscope.compiled_vs_eager import compile_audit

__all__ = [
    "COLUMNS", "COMBINE", "DEFAULT_QUANTITIES", "INITS", "QUANTITIES", "RANK_RULES", "VARIANTS", "Key", "ModelConfig",
    "Quantity", "Recorder", "RecorderOptions", "ReplayOptions", "Site", "SiteNorm", "StepContext", "admin_init",
    "build_model", "compile_audit", "find_spikes", "load", "presets", "record", "save_frame", "site_names", "snapshot",
]
