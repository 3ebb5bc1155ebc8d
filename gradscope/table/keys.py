"""The key of a row as the recorder and the sinks hold it, before the run-wide columns join.

A recorded value is one :class:`Key` and one float; ``run``, ``variant``, ``rank``,
``reduction`` and ``step`` are the same for a whole step and come separately
(:class:`gradscope.sinks.RunInfo`). Field names are the table's columns (docs/table.md).
"""

from __future__ import annotations

from typing import NamedTuple


class Key(NamedTuple):
    """The per-row columns of one recorded value.

    Attributes:
        micro_step: micro-batch index, -1 for the whole step.
        stack: ``"encoder"``, ``"decoder"``, a foreign model's stack path, or ``""``.
        layer: 1-based layer, 0 for an embedding, None elsewhere (matrix rows: row i).
        site: site name, parameter-group prefix, or ``""`` for model-level rows.
        quantity: the quantity's name.
        layer_j: matrix column j, or the head of a per-head row; None otherwise.
        role: what the site or parameter group is (``gradscope.table.ROLES``/``PARAM_ROLES``).
    """

    micro_step: int
    stack: str
    layer: int | None
    site: str
    quantity: str
    layer_j: int | None
    role: str


def model_key(quantity: str, micro_step: int = -1) -> Key:
    """The key of a model-level value (``loss``, ``lr``, a total): no stack, layer or site."""
    return Key(micro_step, "", None, "", quantity, None, "")
