"""The tidy long table (docs/table.md) and the helpers every consumer shares.

- :mod:`gradscope.table.schema`: the columns, their dtypes, the site roles and the
  quantities; building (:func:`make_frame`, :func:`empty_frame`), checking
  (:func:`validate`) and stacking (:func:`concat`) tables.
- :mod:`gradscope.table.select`: choosing rows (by role, run, step) and reducing them to
  one value per point, as the plots (:mod:`gradscope.plots`) and the claims
  (:mod:`gradscope.claims`) do. Both depend on this package, never on each other.
"""

from gradscope.table import select
from gradscope.table.schema import (
    COLUMNS,
    DTYPES,
    PARAM_ROLES,
    ROLES,
    SWEEP_COLUMNS,
    ZOO_SUFFIX_ROLES,
    concat,
    empty_frame,
    make_frame,
    validate,
)

__all__ = [
    "COLUMNS", "DTYPES", "PARAM_ROLES", "ROLES", "SWEEP_COLUMNS", "ZOO_SUFFIX_ROLES", "concat", "empty_frame",
    "make_frame", "select", "validate",
]
