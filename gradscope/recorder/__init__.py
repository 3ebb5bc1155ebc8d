"""The recorder: the quantities of docs/quantities.md as a tidy table, equal to plain autograd.

Usage::

    rec = gradscope.Recorder(model, optimizer=opt)
    model = torch.compile(model)          # optional, before or after the Recorder
    for step, batch in enumerate(loader):
        with rec.step(step):              # covers forward and backward
            loss = loss_fn(model(*batch)); loss.backward()
            rec.log("loss", loss)
        opt.step(); opt.zero_grad()
    df = rec.frame()

The capture lives inside the graph: hooks are installed when the Recorder is made and
removed by ``close()``; steps that are not recorded pass straight through them. Values stay
on the device and reach the host once per recorded step. The recorder never draws from the
global RNG, never re-runs a module and never writes to parameters, buffers or gradients, so
training with and without it is bit-identical, eager or compiled.

The parts, each a subpackage that imports only those before it (``tests/test_recorder_parts.py``):

1. :mod:`~gradscope.recorder.numerics`: exact reductions (‖t‖², a norm's statistics, across ranks);
2. :mod:`~gradscope.recorder.discovery`: where to look in any model (sites, norms, attention,
   sub-layers, parameter groups);
3. :mod:`~gradscope.recorder.capture`: the hooks, taps and device buffers of a recorded step;
4. :mod:`~gradscope.recorder.quantities`: the Quantity contract, the built-ins and their registry;
5. :mod:`~gradscope.recorder.step`: the end of a recorded step (collect, transfer, host values to rows, checks);
6. :mod:`~gradscope.recorder.rows`: the rows' queue and their way to memory and the sinks;
7. :mod:`~gradscope.recorder.replay`: spike replay;

and, composing them, :class:`~gradscope.recorder.recorder.Recorder` with its open step
(:mod:`.session`) and its table side (:mod:`.recorded_table`), its options (:mod:`.options`)
and the one-step helpers (:mod:`.oneshot`).
"""

from gradscope.recorder.discovery.layout import Layout, find_layout
from gradscope.recorder.oneshot import record, snapshot
from gradscope.recorder.options import RecorderOptions
from gradscope.recorder.quantities.quantity import Quantity
from gradscope.recorder.quantities.registry import ALL_QUANTITIES, DEFAULT_QUANTITIES, REGISTRY
from gradscope.recorder.recorder import Recorder

__all__ = ["ALL_QUANTITIES", "DEFAULT_QUANTITIES", "REGISTRY", "Layout", "Quantity", "Recorder", "RecorderOptions",
           "find_layout", "record", "snapshot"]
