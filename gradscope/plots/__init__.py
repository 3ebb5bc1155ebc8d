"""Plot functions over the tidy table (seaborn style).

Each function takes the table of :mod:`gradscope.table` (or a sweep summary), keyword
options and ``ax=None``, draws on one Axes and returns it; none writes into its input.
Axis labels carry units and the loss reduction; the title's last line states the step
and any averaging or masking, and its first line is the caller's ``title`` (preset).
Multi-panel figures are assembled in ``analyses/``.

| function | figure |
|---|---|
| :func:`layer_norms` | Takase 2022 Fig. 3; Wang 2019 §5 (``include_embed=True``) |
| :func:`location_norms` | Takase 2022 Fig. 4 / 7 |
| :func:`cosine_heatmap` | Takase 2022 Fig. 5 |
| :func:`loss_curves` | Takase 2022 Fig. 1 / 6 / 9; Nguyen & Salazar 2019 |
| :func:`depth_sweep` | Takase 2022 Fig. 8; Xu 2020 Tables 1 / 3; Wang 2019 Fig. 3 |
| :func:`dlcl_heatmap`, :func:`dlcl_column` | Wang 2019 Fig. 5 |
| :func:`w_over_sigma` | Xu 2020 Table 2 |
| :func:`scalenorm_g` | Nguyen & Salazar 2019 |
"""

from gradscope.plots.curves import depth_sweep, loss_curves
from gradscope.plots.matrices import cosine_heatmap, dlcl_column, dlcl_heatmap
from gradscope.plots.profiles import layer_norms, location_norms, scalenorm_g, w_over_sigma
from gradscope.plots.select import LOCATIONS, SWEEP_COLUMNS

__all__ = [
    "LOCATIONS",
    "SWEEP_COLUMNS",
    "cosine_heatmap",
    "depth_sweep",
    "dlcl_column",
    "dlcl_heatmap",
    "layer_norms",
    "location_norms",
    "loss_curves",
    "scalenorm_g",
    "w_over_sigma",
]
