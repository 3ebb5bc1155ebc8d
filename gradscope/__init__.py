"""gradscope: gradient, LayerNorm and residual diagnostics for deep Transformers.

Public names:
    ModelConfig, build_model, VARIANTS, INITS, admin_init, presets — the model zoo.
    site_names — the hook points of a model.
    COLUMNS — the tidy table's columns (SPEC §3).
"""

from gradscope import presets
from gradscope.config import ModelConfig
from gradscope.models import INITS, VARIANTS, Site, admin_init, build_model, site_names
from gradscope.table import COLUMNS

__all__ = ["COLUMNS", "INITS", "VARIANTS", "ModelConfig", "Site", "admin_init", "build_model", "presets", "site_names"]
