"""A recorded step's values become rows later, off the training step.

Turning a step's host arrays into table rows (a key per site and quantity, micro-steps,
checks) costs ≈0.3 ms of Python per recorded step of a 150-site model (0.6 ms before the
called slots' sites and keys were kept from step to step): on a GPU, a tenth to a fifth of the rest of
the recorder. So the end of a recorded step only moves the step's values to the
host (one transfer) and queues them here; the rows are built when someone reads them
(``frame()``, ``flush()``, ``save()``, ``close()``, ``state_dict()``), every ``limit``
recorded steps or ``max_wait`` seconds (so that what waits stays small and a live tracker
lags by seconds), and before a ``log_dir`` sink writes a part: it writes the same steps at
the same moment as if nothing had waited, so a killed run loses no more than it did.

The first recorded steps, and every step until a site's hook has fired (in a Recorder that
hooks sites), are built at once: that is where the Recorder finds out whether its hooks
fired, and says so while the user is still looking. Everything the outlet receives (a
step's start, its rows, rows logged later) passes through the same queue, so sinks see the
same order as before.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from gradscope.recorder.rows.outlet import Outlet
from gradscope.table.keys import Key


class LateRows:
    """The queue between the end of a recorded step and the outlet.

    Args:
        outlet: where the rows go.
        build: ``build(step, host)`` -> (keys, values): the rows of one step from what
            :meth:`step` was given.
        limit: recorded steps that may wait before the queue is emptied.
        max_wait: seconds the oldest waiting step may wait.
        at_once: the first recorded steps, built as they end.
    """

    def __init__(self, outlet: Outlet, build: Callable[[int, Any], tuple[list[Key], np.ndarray]], *,
                 limit: int = 64, max_wait: float = 10.0, at_once: int = 2) -> None:
        self.outlet, self.build, self.limit, self.max_wait, self.at_once = outlet, build, limit, max_wait, at_once
        self._queue: list[tuple[str, int, Any]] = []
        self._steps = 0  # recorded steps queued since the last drain
        self._begins = 0  # step starts queued since the last drain
        self._since = 0.0  # when the oldest waiting step was queued
        self.built = 0  # recorded steps built so far

        atexit.register(_drain_at_exit, weakref.ref(self))  # (before the sinks' own exit flush: registered later)

    def __len__(self) -> int:
        return len(self._queue)

    def begin(self, step: int) -> None:
        """A recorded step starts (the sinks are told in order)."""
        if self._queue and self.outlet.writes_part_at(self._begins):
            self.drain()  # the disk sink writes a part now: with every row it would have had
        if self._queue:
            self._queue.append(("begin", step, None))
            self._begins += 1
        else:
            self.outlet.begin(step)

    def step(self, step: int, host: Any, *, now: bool = False) -> None:
        """A recorded step's host values; built now (``now``, or one of the first steps) or later."""
        if now or self.built < self.at_once:
            self.drain()
            self._emit("step", step, host)
            return
        if not self._steps:
            self._since = time.monotonic()
        self._queue.append(("step", step, host))
        self._steps += 1
        if self._steps >= self.limit or time.monotonic() - self._since > self.max_wait:
            self.drain()

    def rows(self, step: int, keys: list[Key], values: np.ndarray) -> None:
        """Rows that are ready (logged after a step, update ratios), kept in order."""
        if self._queue:
            self._queue.append(("rows", step, (keys, values)))
        else:
            self.outlet.append(step, keys, values)

    def drain(self) -> None:
        """Builds and sends everything waiting, in order."""
        queue, self._queue, self._steps, self._begins = self._queue, [], 0, 0
        for i, (kind, step, item) in enumerate(queue):
            try:
                self._emit(kind, step, item)
            except BaseException:
                self._queue = queue[i + 1:] + self._queue  # what is left waits for the next drain
                raise

    def _emit(self, kind: str, step: int, item: Any) -> None:
        if kind == "begin":
            self.outlet.begin(step)
        elif kind == "rows":
            self.outlet.append(step, *item)
        else:
            self.built += 1
            self.outlet.append(step, *self.build(step, item))


def _drain_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit, what waits reaches the sinks (which then flush, as before)."""
    late = ref()
    if late is not None:
        late.drain()
