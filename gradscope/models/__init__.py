"""The model zoo: every residual/LayerNorm wiring of docs/zoo.md ("Variants") with named sites."""

from gradscope.models.admin import admin_init
from gradscope.models.build import build_model
from gradscope.models.inits import INITS
from gradscope.models.sites import Site, SiteNorm, site_names
from gradscope.models.variants import VARIANTS

__all__ = ["INITS", "VARIANTS", "Site", "SiteNorm", "admin_init", "build_model", "site_names"]
