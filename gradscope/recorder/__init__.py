"""The recorder: the quantities of docs/quantities.md as a tidy table, equal to plain autograd."""

from gradscope.recorder.discovery.layout import Layout, find_layout
from gradscope.recorder.oneshot import record, snapshot
from gradscope.recorder.options import RecorderOptions
from gradscope.recorder.quantities.registry import ALL_QUANTITIES, DEFAULT_QUANTITIES, REGISTRY
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.recorder import Recorder

__all__ = ["ALL_QUANTITIES", "DEFAULT_QUANTITIES", "REGISTRY", "Layout", "Quantity", "Recorder", "RecorderOptions",
           "find_layout", "record", "snapshot"]
