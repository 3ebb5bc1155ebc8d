"""‖t‖², the one reduction every recorded site and parameter pays for, to a bound that holds on any CPU.

A single fp32 reduction over a long tensor is as exact as the kernel that runs it: the
same 4 M floats are reduced to 2e-5 relative on one x86 CPU's BLAS ``dot`` and to 1.6e-4
by ``vector_norm`` on another (issue 22). So nothing here sums more than ``BLOCK`` terms
in fp32:

- a tensor of at least ``BLOCK`` elements is viewed as rows of ``BLOCK`` = 64; each row's
  ‖·‖ is one fp32 reduction (``vector_norm(dim=1)``), and the rows' squares are added in
  fp64;
- the remainder, and the many small tensors of ``squared_norms`` (biases, norm gains), are
  reduced in fp64 (their squares are exact there).

The bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002, Lemma 3.1 and
Eq. 4.4: a sum of k non-negative terms in any order is within γ_{k-1} = (k-1)u/(1-(k-1)u)
relative): each row carries at most 64 roundings of its squares and partial sums plus 2
from the fp32 square root squared again, the fp64 sum of the rows adds < 1e-8 up to 2^26
elements, and the fp32 result one more, so the relative error is at most
67·2⁻²⁴ ≈ 4.0e-6 *whatever kernel runs and in whatever order it adds*. ATen's kernels add
a row in several interleaved lanes at every CPU capability, and the error measured on
adversarial data (one large value swamping 63 small ones per row, a large common offset,
mixed magnitudes) is ≤ 4e-7; ``tests/test_recorder_sqnorm.py`` holds it to 1e-6 against
an fp64 sum at 2^20 to 2^26 elements.

Traced by Dynamo (compiled capture), the sum is written so that Inductor fuses it: 8
columns of the tensor squared and added in fp32, the column sums in fp64, with no square
root. Inductor may add those 8 terms in one sequence (it does at
``ATEN_CPU_CAPABILITY=default``, where a single 64-term row reached the 4e-6 above), so
the bound there is proven, not measured: 9·2⁻²⁴ ≈ 5.4e-7 for any kernel.

The cost is that of one pass over the data: within 10 % of BLAS ``dot`` on a cold 131 k-
float activation and equal to it from 1 M floats on (measured on the project's CPU); the
traced form costs about what Inductor's own fp32 ``vector_norm`` did.
"""

from __future__ import annotations

import operator
import weakref

import torch

BLOCK = 64  # eager: terms an fp32 partial sum may hold; the bound above is (BLOCK + 3)·2⁻²⁴
TRACED_BLOCK = 8  # traced: terms per fp32 partial sum; the bound is (TRACED_BLOCK + 1)·2⁻²⁴ ≈ 5.4e-7
DENSE_MIN = 1 << 14  # CPU: elements from which a tensor gets its own blocked reduction; below, one fused fp64 ``_foreach_norm``
RELATIVE_ERROR_BOUND = (BLOCK + 3) * 2.0**-24  # the worst case above, eagerly, for any kernel
TRACED_ERROR_BOUND = (TRACED_BLOCK + 1) * 2.0**-24  # the worst case under torch.compile, for any kernel


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """‖t‖² as a 0-d fp32 tensor on ``t``'s device (no graph is recorded: ``t`` is detached).

    Exact to ``RELATIVE_ERROR_BOUND`` (≈4e-6, ≤ 4e-7 measured) whatever the kernel: at most
    ``BLOCK`` terms are ever summed in fp32 (see the module docstring).

    Args:
        t: any floating-point tensor (strided, sparse COO or another layout).

    Returns:
        The sum of squares of ``t``'s elements.
    """
    return dense_squared_norm(_values(t).detach())


def dense_squared_norm(t: torch.Tensor) -> torch.Tensor:
    """:func:`squared_norm` of a strided tensor that records no graph (a gradient inside an
    ``autograd.Function``'s backward, where Dynamo's strict mode reads no ``layout``)."""
    flat = t.reshape(-1)
    n = flat.numel()
    if torch.compiler.is_compiling():  # Inductor fuses it: square and add 8 terms per column, columns in fp64
        head = n - n % TRACED_BLOCK
        if head == 0 or flat.dtype == torch.float64:
            return flat.double().square().sum().float()
        cols = flat[:head].view(TRACED_BLOCK, -1).float().square().sum(dim=0)
        return (cols.double().sum() + flat[head:].double().square().sum()).float()
    head = n - n % BLOCK
    if n < DENSE_MIN or flat.dtype == torch.float64:  # short: one fp64 reduction (exact squares and sums)
        return torch.linalg.vector_norm(flat, dtype=torch.float64).square().float()
    rows = torch.linalg.vector_norm(flat[:head].view(-1, BLOCK), dim=1, dtype=torch.float32).double()
    sq = rows.square().sum()
    if head < n:
        sq = sq + torch.linalg.vector_norm(flat[head:], dtype=torch.float64).square()
    return sq.float()


def squared_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """‖t‖² of each tensor, stacked into one fp32 vector, each to the bound of :func:`squared_norm`.

    On the CPU, tensors of at least ``DENSE_MIN`` elements are reduced one by one in blocks
    (there the pass over memory is the cost) and the many small ones (biases, norm gains)
    by one fused fp64 ``_foreach_norm`` (there the Python call is); elsewhere each tensor
    goes through :func:`squared_norm` if it is long and one fp64 ``_foreach_norm`` takes
    the rest, so a GPU launches a fixed few kernels for the small ones.

    Args:
        tensors: a non-empty list of floating-point tensors on one device.

    Returns:
        A (len(tensors),) fp32 vector.
    """
    tensors = [t if t.layout == torch.strided else _values(t) for t in tensors]
    return fp64_squared_norms([t.detach() for t in tensors]).float()


def fp64_squared_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """fp64 ‖t‖² of each of ``tensors`` (a non-empty list), in order, in a fixed few operations:
    one stack when all are short and share shape and dtype (site values and gradients, the
    usual case), else the :class:`SquaredNormPlan` kept for these shapes (the one home of
    the plans: gradients, parameters and site batches all come here). The plan used last
    for a list of this length is tried first (:meth:`SquaredNormPlan.fits`): a model's
    gradients come step after step with the same shapes, and building the key of a
    258-tensor list costs as much as the plan's call."""
    last = _PLANS.get(len(tensors))  # the plan used last for a list this long, tried first
    if last is not None and last.fits(tensors):  # (a model's gradients, step after step)
        return last(tensors)
    shapes, dtypes = list(map(_shape, tensors)), list(map(_dtype, tensors))
    n = len(tensors)
    with torch.no_grad():
        if shapes.count(shapes[0]) == n and dtypes.count(dtypes[0]) == n and 0 < tensors[0].numel() < DENSE_MIN:
            stacked = _stacked_squared_norms(tensors)
            if stacked is not None:  # (else tensors on several devices: the plan groups them by device)
                return stacked
        key = (tuple(shapes), tuple(dtypes), tensors[0].device)
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) >= 32:  # shapes that keep changing (variable sequence lengths): keep a few
                _PLANS.clear()
            plan = _PLANS[key] = SquaredNormPlan(tensors)
        _PLANS[n] = plan
        return plan(tensors)


def plan_for(tensors: list[torch.Tensor]) -> SquaredNormPlan | None:
    """The plan :func:`fp64_squared_norms` keeps for ``tensors``' shapes, if it made one (not
    for a list it stacked)."""
    plan = _PLANS.get(len(tensors))
    return plan if plan is not None and plan.fits(tensors) else None


class SquaredNormPlan:
    """‖t‖² of each tensor of a list that keeps its shapes from call to call (a model's
    gradients or parameters, step after step), in a fixed few operations however long the list.

    Built once from a list, it groups the short tensors (fewer than ``DENSE_MIN`` elements:
    biases, gains, the weights of a narrow model) by trailing shape, dtype and device. A call
    concatenates each group along its first dimension, squares and sums every row in fp64
    (exact squares and sums, as :class:`NormBatch`) and adds the rows into their tensors'
    slots with one ``index_add_``; long tensors go one by one through :func:`squared_norm`.
    So the host work of a call is a list comprehension per group, not a reduction per tensor
    (0.41 → 0.07 ms for the 258 gradients of the d=16 benchmark model on the project's CPU).

    Args:
        tensors: the list as it will come (a non-empty list of floating-point tensors).
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.n = len(tensors)
        self.device = tensors[0].device
        groups: dict[tuple, list[int]] = {}
        self.long: list[int] = []
        for k, t in enumerate(tensors):
            n = t.numel()
            if n >= DENSE_MIN or n == 0 or t.dim() == 0 or t.layout != torch.strided:
                self.long.append(k)
            else:
                groups.setdefault((tuple(t.shape[1:]), t.dtype, t.device), []).append(k)
        self.groups = []  # (indices, row -> slot on the output's device, rows)
        for at in groups.values():
            rows = [tensors[i].shape[0] for i in at]
            owner = torch.repeat_interleave(torch.tensor(at), torch.tensor(rows)).to(self.device)
            self.groups.append((at, owner, sum(rows)))
        self.long_at = torch.tensor(self.long, device=self.device)
        self.shapes, self.dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
        self.joined = [(rows, *tensors[at[0]].shape[1:]) for at, _, rows in self.groups]  # each group's cat

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` have the shapes and dtypes the plan was built for, and the
        first of them its device (as the plans' key has it; a few passes of C-level compares)."""
        return (len(tensors) == self.n and list(map(_shape, tensors)) == self.shapes
                and list(map(_dtype, tensors)) == self.dtypes and tensors[0].device == self.device)

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """fp64 ‖t‖² of each of ``tensors`` (the shapes the plan was built for), in order."""
        out = self.if_joined(tensors)
        if out is None:
            raise ValueError("SquaredNormPlan: the tensors do not have the shapes the plan was built for")
        return out

    def if_joined(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """:meth:`__call__` for a list of the same tensors' successors in the same places,
        whose shapes can only have changed by a tensor reshaped since (the gradients of the
        same parameters, step after step, with the same ones missing: the caller's to
        ensure): each group's concatenation is checked for the shape it had (a tensor of
        another trailing shape, or a group with other rows in total, gives None) instead of
        every tensor's shape (≈ 0.3 µs a tensor whose metadata has left the CPU's caches).
        Only two tensors of one group whose leading dimensions changed by opposite amounts
        would pass unseen, which a model's parameters do not do."""
        if len(tensors) != self.n or tensors[0].device != self.device:
            return None
        with torch.no_grad():
            out = torch.zeros(self.n, dtype=torch.float64, device=self.device)
            for (at, owner, rows), joined in zip(self.groups, self.joined):
                try:
                    stacked = torch.cat([tensors[i] for i in at])
                except RuntimeError:  # (trailing shapes that no longer match)
                    return None
                if stacked.shape != joined:
                    return None
                out.index_add_(0, owner, _squared_rows(stacked.reshape(rows, -1)).to(self.device))
            if self.long:
                sq = torch.stack([squared_norm(tensors[i]).to(self.device) for i in self.long])
                out.index_put_((self.long_at,), sq.double())
            return out


def _squared_rows(joined: torch.Tensor) -> torch.Tensor:
    """fp64 Σ x² of each row of ``joined``, a concatenation this module made (``torch.cat``
    always copies, so the tensor is its own even when ``double()`` returns it as it is): squared
    in place in its fp64 copy, one temporary fewer than ``square()`` (365 → 311 µs for the
    gradients of the d=16 benchmark model in a training loop, same bits)."""
    d = joined.double()
    return d.mul_(d).sum(1)


_PLANS: dict[tuple | int, SquaredNormPlan] = {}  # (shapes, dtypes, device), or a list's length -> plan: fp64_squared_norms
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_version = operator.attrgetter("_version")


class Reused:
    """‖t‖² of the last tensor reduced, given again without a second pass when the very same
    tensor (same object, same version) comes next: a layer's output is the next layer's
    input, and backward hands one gradient to both."""

    def __init__(self) -> None:
        self._last: tuple | None = None  # (weakref to the tensor, its version, ‖t‖²)

    def clear(self) -> None:
        """Forgets the last tensor."""
        self._last = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """‖t‖², reduced only if ``t`` is not the tensor reduced last (at the same version)."""
        last = self._last
        if last is not None and last[0]() is t and last[1] == t._version:
            return last[2]
        sq = squared_norm(t)
        self._last = (weakref.ref(t), t._version, sq)
        return sq

    def passed_on(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (an alias or a tap's output) now carries the value of ``t``, the tensor reduced last."""
        last = self._last
        if last is not None and last[0]() is t:
            self._last = (weakref.ref(out), out._version, last[2])



class NormBatch:
    """‖t‖² of many tensors handed over one at a time, reduced together when taken.

    A hook hands over a site's tensor (:meth:`add`) instead of reducing it then: a short
    tensor (fewer than ``DENSE_MIN`` elements: the host-bound case) is only appended to a
    list, and :meth:`take` reduces the list with :func:`fp64_squared_norms` (one stack, or
    a few concatenations; fp64 squares and sums), so a hundred sites cost a few reductions
    instead of a hundred. Long tensors are reduced at once by
    :func:`squared_norm` (there the pass over memory is the cost), once for the same tensor
    (same object and version) handed over twice in a row: a layer's output is the next
    layer's input, and backward hands one gradient to both. Past ``limit`` waiting elements
    the waiting tensors are reduced at once.

    A short tensor handed over must not be modified in place before it is taken (a
    gradient during backward, or a site output of a model that promises it); one that was
    raises at :meth:`take`.
    """

    def __init__(self, limit: int = 1 << 22) -> None:
        self.limit = limit
        self._stackable = True  # until tensors of several shapes came: then fp64_squared_norms
        self._long = Reused()
        self.clear()

    def clear(self) -> None:
        """Drops everything handed over."""
        self._slots: list[int] = []
        self._tensors: list[torch.Tensor] = []
        self._versions: list[int] = []  # a waiting tensor changed in place would give a stale norm
        self._elements = 0
        # (slots, fp64 ‖·‖²) of the short tensors reduced so far, and (slots, [0-d fp32 ‖·‖²])
        # runs of long ones in between, in the order they came (stacked once at take)
        self._done: list[tuple[list[int], torch.Tensor | list[torch.Tensor]]] = []
        self._long.clear()

    def add(self, slot: int, t: torch.Tensor) -> bool:
        """‖t‖² for ``slot``, taken later. Returns whether ``t`` itself waits (short and
        strided: reduced at :meth:`take`; no reduction of it to pass on, :meth:`passed_on`)."""
        n = t.numel()
        if n >= DENSE_MIN or n == 0 or t.layout != torch.strided:
            sq = self._long(t)
            last = self._done[-1] if self._done else None
            if last is not None and type(last[1]) is list and last[1][0].device == sq.device:  # (one stack at take)
                last[0].append(slot)
                last[1].append(sq)
            else:
                self._done.append(([slot], [sq]))
            return False
        self._slots.append(slot)
        self._tensors.append(t)
        self._versions.append(t._version)
        self._elements += n
        if self._elements >= self.limit:
            self._reduce()
        return True

    def add_many(self, slots: list[int], tensors: list[torch.Tensor], *, short: bool = False) -> None:
        """:meth:`add` of each (slot, tensor), appended in one go when all are short and
        strided (``short=True``: the caller knows they are, as for retained gradients)."""
        if not short and any(t.numel() >= DENSE_MIN or t.numel() == 0 or t.layout != torch.strided for t in tensors):
            for slot, t in zip(slots, tensors):
                self.add(slot, t)
            return
        self._slots += slots
        self._tensors += tensors
        self._versions += map(_version, tensors)
        self._elements += sum(map(torch.Tensor.numel, tensors))
        if self._elements >= self.limit:
            self._reduce()

    def passed_on(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (an alias or a tap's output) now carries the value of ``t``."""
        self._long.passed_on(t, out)

    def _reduce(self) -> None:
        tensors = self._tensors
        if not tensors:
            return
        if list(map(_version, tensors)) != self._versions:
            changed = [t for t, v in zip(tensors, self._versions) if t._version != v]
            self.clear()
            raise RuntimeError(f"gradscope: {len(changed)} site tensor(s) of shape {tuple(changed[0].shape)} were modified "
                               "in place after the site and before their norm was taken; the model's "
                               "site_outputs_never_modified_in_place promise does not hold (remove it)")
        sq = _stacked_squared_norms(tensors) if self._stackable else None
        if sq is None:  # (tensors of several shapes: so they stay, as a model's sites keep theirs)
            self._stackable = False
            sq = fp64_squared_norms(tensors)
        self._done.append((self._slots, sq))
        self._slots, self._tensors, self._versions, self._elements = [], [], [], 0

    def take(self) -> tuple[list[int], torch.Tensor | None]:
        """(slots, fp32 ‖t‖² per slot) of everything added since the last take; then clears."""
        self._reduce()
        done = self._done
        self.clear()
        if not done:
            return [], None
        slots = done[0][0] if len(done) == 1 else [s for part, _ in done for s in part]
        parts = [torch.stack(v).double() if type(v) is list else v for _, v in done]
        sq = parts[0] if len(parts) == 1 else torch.cat([v.to(parts[0].device) for v in parts])
        return slots, sq.float()


def _stacked_squared_norms(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """fp64 ‖t‖² of short strided tensors of one shape, in one stack and one fp64 reduction
    (exact squares and sums). A :class:`NormBatch` calls it without reading the shapes
    first, as ``torch.stack`` checks them itself (reading 150 shapes that have left the
    CPU's caches cost half as much as the stack). None if the shapes (or devices) differ."""
    with torch.no_grad():
        try:
            stacked = torch.stack(tensors)
        except RuntimeError:
            return None
        return torch.linalg.vector_norm(stacked.reshape(len(tensors), -1), dim=1, dtype=torch.float64).square()


def _values(t: torch.Tensor) -> torch.Tensor:
    """A strided tensor with the same sum of squares: a nested tensor (``nn.TransformerEncoder``'s
    fast path under ``no_grad`` with a padding mask) padded with zeros, a sparse COO tensor's
    coalesced values (duplicates summed first), another layout made dense."""
    if t.is_nested:
        return t.detach().to_padded_tensor(0.0)
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t.detach().coalesce().values()
    return t.detach().to_dense()
