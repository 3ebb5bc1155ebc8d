"""``gradscope.config``: the model configuration, kept under this name for existing imports.

It lives in :mod:`gradscope.models.config`, beside the registries it is checked against, so
that models and their configuration import one way.
"""

from gradscope.models.config import DLCL_WEIGHT_INITS, DS_INIT_FORMS, INIT_OPTIONS, VARIANT_OPTIONS, ModelConfig

__all__ = ["DLCL_WEIGHT_INITS", "DS_INIT_FORMS", "INIT_OPTIONS", "VARIANT_OPTIONS", "ModelConfig"]
