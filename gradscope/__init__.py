"""gradscope: gradient, LayerNorm and residual diagnostics for deep Transformers.

Public names:
    ModelConfig, build_model, VARIANTS, INITS, admin_init, presets — the model zoo.
    site_names — the sites the recorder probes in a model (zoo or any nn.Module).
    Recorder, record, snapshot — the recorder; RecorderOptions — its less common settings.
    Quantity, StepContext — write a quantity of your own; QUANTITIES — the built-in ones.
    compile_audit — one batch eager and compiled, compared site by site (docs/compile.md).
    load, save_frame — parquet I/O. COLUMNS — the tidy table's columns (docs/table.md).
"""

from gradscope import presets
from gradscope.config import ModelConfig
from gradscope.models import INITS, VARIANTS, Site, SiteNorm, admin_init, build_model
from gradscope.io import load, save_frame
from gradscope.recorder import Recorder, RecorderOptions, record, snapshot
from gradscope.recorder.quantities.context import StepContext
from gradscope.recorder.quantities.registry import QUANTITY_NAMES as QUANTITIES
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.discovery.layout import site_names
from gradscope.table import COLUMNS
from gradscope.compiled_vs_eager import compile_audit

__all__ = [
    "COLUMNS", "INITS", "QUANTITIES", "VARIANTS", "ModelConfig", "Quantity", "Recorder", "RecorderOptions", "Site",
    "SiteNorm", "StepContext", "admin_init", "build_model", "compile_audit", "load", "presets", "record", "save_frame", "site_names",
    "snapshot",
]
