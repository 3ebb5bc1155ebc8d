"""Capture inside the graph: identity taps at the sites, statistics into device buffers.

Hooks are installed once, when the Recorder is made, and removed by ``close()``; on a step
that is not recorded each hook returns at once. On a recorded step:

- a site's value passes through :class:`Tap`, an identity ``autograd.Function`` whose
  backward also returns ‖grad‖² as the gradient of a small *collector* leaf vector, one slot
  per (site, call). Autograd sums those into ``collector.grad``, so every activation-gradient
  norm of a backward arrives in one vector, with no Python hook in the backward and no
  host sync. The tap's output is a detached alias of its input (same storage, same version
  counter), so an in-place op after a site behaves exactly as without the recorder;
- run eagerly (not traced), a module's output is read more cheaply where that is exact: by
  a pre-hook on the autograd node that made it, or on an alias of it
  (:mod:`gradscope.recorder.capture.eager` says when). Other module inputs keep the Tap, whose
  gradient is the one through that module alone;
- forward statistics (the site's ‖h‖, a norm's w/σ, sampled rows for ``cosine``) are
  written in place into device buffers;
- when ``collector.grad`` is accumulated (the end of each backward) one hook copies it and the
  forward buffer aside: one snapshot per micro-step.

Everything a hook does is traceable by Dynamo, so ``torch.compile(model, fullgraph=True)``
works with no graph break; whether a step records is a Python flag, so recorded and
unrecorded steps compile one graph each and then never again. Nothing is re-run, nothing
draws from the global RNG, no buffer of the user's is touched, and values reach the host
once per recorded step.

A module called several times in one forward (a shared layer) gets one slot per call, up
to ``max_calls``; later calls add into the last slot (and the Recorder warns).

The part holds what a recorded step reads from the model on the device: the permanent module hooks
(:mod:`.hookset`, :mod:`.site_hooks`), the taps that carry gradient norms out of backward
(:mod:`.taps`, :mod:`.eager`, :mod:`.norm_edges`), the device buffers they write (:mod:`.capture`,
:mod:`.step_buffer`), the forward signals (:mod:`.signals`, :mod:`.attention_signals`), MoE routers
(:mod:`.routers`), cosine samples, parameter-gradient
norms (:mod:`.params`) and the optimizer's and GradScaler's step (:mod:`.optimizer_step`,
:mod:`.scaler_watch`).

Imports :mod:`~gradscope.recorder.numerics` and :mod:`~gradscope.recorder.discovery`.
"""
