"""Plot functions over the tidy table (seaborn style).

Each function takes the table of :mod:`gradscope.table` (or a sweep summary, or a scan's layers), keyword
options and ``ax=None``, draws on one Axes and returns it; none writes into its input.
Axis labels carry units and the loss reduction; the title's last line states the step
and any averaging or masking, and its first line is the caller's ``title`` (preset).
Multi-panel figures are assembled in ``analyses/``.

| function | figure |
|---|---|
| :func:`layer_norms` | Takase 2022 Fig. 3; Wang 2019 §5 (``include_embed=True``) |
| :func:`embed_grad_vs_depth` | Wang 2019 §5 (embedding gradient against encoder depth) |
| :func:`ln_gains` | Takase 2022 §3 (backward gain of each LayerNorm) |
| :func:`location_norms` | Takase 2022 Fig. 4 / 7 |
| :func:`cosine_heatmap` | Takase 2022 Fig. 5 |
| :func:`loss_curves` | Takase 2022 Fig. 1 / 6 / 9; Nguyen & Salazar 2019 |
| :func:`depth_sweep` | Takase 2022 Fig. 8; Xu 2020 Tables 1 / 3; Wang 2019 Fig. 3 |
| :func:`dlcl_heatmap`, :func:`dlcl_column` | Wang 2019 Fig. 5 |
| :func:`w_over_sigma`, :func:`w_over_sigma_curves` | Xu 2020 Table 2 |
| :func:`scalenorm_g` | Nguyen & Salazar 2019 |
| :func:`scan_layers` | ``gradscope scan``'s per-layer profile |
| :func:`layer_heatmap`, :func:`layer_series` | a run over time (``gradscope report``) |
| :func:`expert_load_by_layer`, :func:`quantity_by_site` | the ``moe`` and ``outliers`` sets at one step (``gradscope report``) |
| :func:`lr_sensitivity`, :func:`signal_over_training` | Wortsman 2023 Fig. 1; signals before instability |
| :func:`compile_audit_profile` | ``gradscope.compile_audit``: eager vs compiled, value by value |
| :func:`spike_watch`, :func:`replay_profile` | spike replay (issue 26): the watch, and where the gradient jumped |
| :func:`expert_load`, :func:`routing_series` | mixture of experts: expert load per layer over steps, routing statistics |
"""

from gradscope.plots.compile_audit import compile_audit_profile
from gradscope.plots.curves import depth_sweep, loss_curves, w_over_sigma_curves
from gradscope.plots.instability import lr_sensitivity, signal_over_training
from gradscope.plots.matrices import cosine_heatmap, dlcl_column, dlcl_heatmap
from gradscope.plots.moe import expert_load, routing_series
from gradscope.plots.over_time import layer_heatmap, layer_series
from gradscope.plots.quantity_sets import expert_load_by_layer, quantity_by_site
from gradscope.plots.profiles import (
    embed_grad_vs_depth,
    layer_norms,
    ln_gains,
    location_norms,
    scalenorm_g,
    scan_layers,
    w_over_sigma,
)
from gradscope.plots.replay import replay_profile, spike_watch
from gradscope.table import SWEEP_COLUMNS
from gradscope.table.select import LOCATIONS

__all__ = [
    "LOCATIONS",
    "SWEEP_COLUMNS",
    "compile_audit_profile",
    "cosine_heatmap",
    "depth_sweep",
    "dlcl_column",
    "dlcl_heatmap",
    "embed_grad_vs_depth",
    "expert_load",
    "expert_load_by_layer",
    "layer_heatmap",
    "layer_norms",
    "layer_series",
    "ln_gains",
    "location_norms",
    "loss_curves",
    "lr_sensitivity",
    "quantity_by_site",
    "replay_profile",
    "routing_series",
    "scalenorm_g",
    "scan_layers",
    "signal_over_training",
    "spike_watch",
    "w_over_sigma",
    "w_over_sigma_curves",
]
