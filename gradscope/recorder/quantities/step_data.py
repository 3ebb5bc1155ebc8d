"""One recorded step on the host: the captured arrays, and how per-site values become rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from gradscope.recorder.discovery.layout import Layout, RecordedSite
from gradscope.recorder.quantities.combine import Row, combine
from gradscope.table.keys import Key


@dataclass(kw_only=True)
class StepData:
    """One recorded step on the host, after its single device→host transfer.

    ``grad_sq`` (M, sites·K) holds ‖∂loss/∂h‖² per micro-step and slot, already unscaled;
    ``arrived`` (M, sites·K) whether that gradient reached the site (a site that backward did
    not reach, as after ``backward(inputs=...)``, has no gradient, which is not a zero one);
    ``order`` (M, slots) the forward order of each slot's call (+ tapped, − not tapped, 0 not
    called); ``value`` (M, slots) the forward statistic (‖h‖ for sites, w/σ for norms).
    """

    layout: Layout
    sites: list[RecordedSite]
    K: int
    grad_sq: np.ndarray
    arrived: np.ndarray
    order: np.ndarray
    value: np.ndarray
    collected: dict[str, list[Row]] = field(default_factory=dict)  # quantity -> rows of what its collect() added
    blocks: dict[str, np.ndarray] = field(default_factory=dict)  # raw arrays from the device
    unfit: set[str] = field(default_factory=set)  # norms whose w/σ the call does not tell (no ln_w_over_sigma rows)
    grad_left_out: set[str] = field(default_factory=set)  # norms whose gradient rows are left out (closed form, bf16)
    no_backward: bool = False  # forward tapped gradients but no backward ran inside the step: no gradient rows
    low_precision: set[str] = field(default_factory=set)  # norms called on bf16/fp16 tensors that lost rows (in unfit)
    user_values: dict[str, np.ndarray] = field(default_factory=dict)  # quantity -> (M, taps) of its site_value
    user_grads: dict[str, np.ndarray] = field(default_factory=dict)  # quantity -> (M, taps) of its site_grad
    untold: set[str] = field(default_factory=set)  # fitted norms whose w/σ the call could not tell (in unfit)
    guessed: set[str] = field(default_factory=set)  # fitted norms whose unnamed eps was guessed for w/σ (rows kept)
    traced: np.ndarray | None = None  # (M, taps) bool: slots a compiled call marked (their arrival is not seen)
    backwards: int = 1  # backwards the capture saw in the step
    grad_forwards: int = 1  # forwards of the step that ran with grad enabled
    key_cache: dict = field(default_factory=dict)  # the Recorder's: step-row keys kept from step to step (step_keys)
    # (taps,) bool: slots that took several calls in one micro-step (several forwards in it, or calls
    # past max_calls sharing the last slot): a user's site statistic holds the last value (site_value)
    # or the sum of the values (site_grad) there, not their combination by its rule: no rows
    merged: np.ndarray | None = None

    @property
    def micro_steps(self) -> int:
        return self.grad_sq.shape[0]

    def micro(self, m: int) -> int:
        """The micro_step column for micro-step m (-1 when the step had only one)."""
        return m if self.micro_steps > 1 else -1

    @property
    def got(self) -> np.ndarray:
        """(M, taps) bool: micro-steps in which a slot's gradient arrived."""
        return self.arrived

    @cached_property
    def missed(self) -> np.ndarray:
        """(M, taps) bool: micro-steps in which a slot was tapped for its gradient and a
        backward ran (another slot's gradient arrived) but its own never came. Eagerly,
        backward did not reach it (``backward(inputs=...)``, or a value that does not feed
        the loss); for a compiled call (:attr:`traced`), the compiled capture did not see
        that backward (one given ``inputs=``)."""
        tapped = self.order[:, : self.grad_sq.shape[1]] > 0
        return tapped & ~self.arrived & self.arrived.any(axis=1, keepdims=True)

    @property
    def traced_taps(self) -> np.ndarray:
        """(M, taps) bool: :attr:`traced`, all False when not given."""
        return self.traced if self.traced is not None else np.zeros_like(self.arrived)

    @cached_property
    def _called(self) -> tuple[tuple[tuple[RecordedSite, int, int, str], ...], tuple[int, ...], np.ndarray]:
        """(point, call, slot, site name) of every slot called, and the slots as a tuple and
        an array: the same step after step, so kept in ``key_cache`` by which slots were called."""
        seen = (self.order[:, : self.grad_sq.shape[1]] != 0).any(axis=0) | self.arrived.any(axis=0)
        return self.key_cache_get(("slot sites", seen.tobytes()), lambda: self._slot_sites_of(seen))

    def _slot_sites_of(self, seen: np.ndarray) -> tuple[tuple[tuple[RecordedSite, int, int, str], ...], tuple[int, ...], np.ndarray]:
        slots = np.flatnonzero(seen)
        slots.flags.writeable = False  # (shared by later steps)
        listed = tuple(slots.tolist())
        sites = tuple((self.sites[slot // self.K], slot % self.K, slot,
                       call_name(self.sites[slot // self.K].name, slot % self.K)) for slot in listed)
        return sites, listed, slots

    @property
    def _sites(self) -> tuple[tuple[RecordedSite, int, int, str], ...]:
        return self._called[0]

    def slot_sites(self) -> tuple[tuple[RecordedSite, int, int, str], ...]:
        """(point, call, slot, site name) of every (site, call) slot called in the step (a
        tuple: later steps that call the same slots share it)."""
        return self._sites

    def step_keys(self, quantity: str) -> tuple[Key, ...]:
        """The keys of ``quantity``'s step rows (micro_step -1), one per slot of
        :meth:`slot_sites`, in its order (made once: :meth:`kept_keys`)."""
        return self.kept_keys((quantity, self._called[1]), lambda: [Key(-1, p.stack, p.layer, site, quantity, None, p.role)
                                                                    for p, _, _, site in self._sites])

    def slots(self) -> np.ndarray:
        """The slots of :meth:`slot_sites`, in its order (an int array; read-only)."""
        return self._called[2]

    def kept_keys(self, which: tuple, make: Callable[[], list[Key]]) -> tuple[Key, ...]:
        """The row keys ``which`` names (a tuple that starts with the quantity's name), made
        by ``make()`` the first time. The same slots are called step after step, so keys are
        made once and kept in the Recorder's ``key_cache``: the same Key objects each step,
        which the row store finds by identity. A tuple, as later steps share it."""
        return self.key_cache_get(which, lambda: tuple(make()))

    def key_cache_get(self, which: tuple, make: Callable[[], object]) -> object:
        """What ``key_cache`` holds under ``which``, made by ``make()`` the first time."""
        kept = self.key_cache.get(which)
        if kept is None:
            if len(self.key_cache) >= 256:  # (slots that keep changing: keep a few)
                self.key_cache.clear()
            kept = self.key_cache[which] = make()
        return kept

    @cached_property
    def value_called(self) -> np.ndarray:
        """(M, taps) bool: micro-steps in which a slot's forward value was seen."""
        return self.order[:, : self.grad_sq.shape[1]] != 0

    def site_rows(self, quantity: str, values: np.ndarray, seen: np.ndarray, how: str) -> list[Row]:
        """Rows of a per-site statistic: ``values`` (M, taps) where ``seen`` (M, taps), per
        micro-step when the step had several, and the step's row combined by ``how``
        (:data:`~gradscope.recorder.quantities.quantity.COMBINE`)."""
        if self.micro_steps == 1:  # one row per site, with the keys kept from step to step
            slots = self.slots()
            combined = combine(values[:, slots], how).tolist()  # (one reduction for every site)
            return [(k, v) for k, v, g in zip(self.step_keys(quantity), combined, seen[0, slots].tolist()) if g]
        out = []
        for p, _, slot, site in self.slot_sites():
            got = seen[:, slot]
            if not got.any():
                continue
            out += [(Key(m, p.stack, p.layer, site, quantity, None, p.role), float(values[m, slot]))
                    for m in np.flatnonzero(got).tolist()]
            out.append((Key(-1, p.stack, p.layer, site, quantity, None, p.role), float(combine(values[got, slot], how))))
        return out


def call_name(name: str, call: int) -> str:
    """Site name of the call-th (0-based) call of a module: ``name``, ``name#2``, ..."""
    return name if call == 0 else f"{name}#{call + 1}"
