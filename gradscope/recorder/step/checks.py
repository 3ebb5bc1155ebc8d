"""What a Recorder tells its user about recorded steps: one warning per topic, or an error.

:class:`StepChecks` holds the Recorder's memory of what it has said and seen: the topics
already warned about, whether any hook has fired yet, and the highest step recorded.
"""

from __future__ import annotations

import warnings

from gradscope.recorder.capture.params import GradsSeen, ParamGroups, grads_seen
from gradscope.recorder.discovery.layout import Layout, RecordedSite
from gradscope.user_frames import user_stacklevel
from gradscope.recorder.quantities.step_data import StepData

NO_HOOK_FIRED = (
    "Recorder: backward ran in this step but none of the recorder's hooks fired: the forward that ran "
    "was not the recorded model's module calls. Most likely a copy of the model other than the one the "
    "Recorder was given ran (copy.deepcopy, a TorchScript or torch.export copy), or a CUDA graph replayed "
    "it. Give the Recorder the model (or its torch.compile wrapper) that the training step calls."
)


class StepChecks:
    """The warnings (once per topic) and errors of one Recorder's recorded steps.

    Args:
        groups: the recorded model's parameters (their gradients tell whether backward ran).
        layout: its sites, norms and stacks.
        sites: the probed sites, in the capture's order.
        max_calls: slots per site (the capture's K).
    """

    def __init__(self, groups: ParamGroups, layout: Layout, sites: list[RecordedSite], max_calls: int,
                 grad_expected: list[bool] | None = None, sites_hooked: bool = True) -> None:
        self.groups, self.layout, self.sites, self.K = groups, layout, sites, max_calls
        self.sites_hooked = sites_hooked  # False: no quantity reads the sites, so no site hook fires by design
        self.grad_expected = grad_expected or [True] * len(sites)  # per point: its gradient is read when it has one
        self.warned: set[str] = set()
        self.ever_seen = False  # any hook fired in a recorded step
        self.last_recorded: int | None = None  # the highest step recorded so far
        self._grads_seen: GradsSeen | None = None  # when the last recorded step began, until a hook fired
        self._sites_said: tuple | None = None  # the slot sites of the last step checked for silent sites

    @property
    def awaiting_hooks(self) -> bool:
        """Whether a recorded step's rows are built at once, to say while the user looks whether
        the hooks fired: the sites are hooked and none has fired yet."""
        return self.sites_hooked and not self.ever_seen

    def warn_once(self, topic: str, message: str) -> None:
        """Warns ``gradscope: <message>`` at the user's line the first time ``topic`` comes up."""
        if topic not in self.warned:
            self.warned.add(topic)
            warnings.warn(f"gradscope: {message}", stacklevel=user_stacklevel())

    def resume(self, last: int | None) -> None:
        """A checkpoint was loaded whose highest recorded step is ``last`` (None: none)."""
        self.last_recorded = last

    def begin(self, step: int) -> None:
        """A recorded step opens: warns (once) when it repeats or goes back, and notes the
        gradients' versions until a hook has fired (to tell an unhooked compiled model)."""
        last = self.last_recorded
        if last is not None and step <= last:
            self.warn_once("repeat", f"step {step} recorded after step {last}: step indices should increase, or the "
                           "table holds a step twice (a Recorder without log_dir keeps both in rec.frame(); with log_dir, "
                           "rec.frame() and gradscope.load keep the last write of each step and quantity). Pass the "
                           "global step to rec.step(). Not reported again.")
        self.last_recorded = step if last is None else max(step, last)
        if self.awaiting_hooks:  # (the parameters' gradients read: only until a hook has fired)
            self._grads_seen = grads_seen(self.groups.params)

    def merged(self, step: int, names: list[str]) -> None:
        """Warns (once) that ``names``, site statistics of the user's, have no rows at slots
        that took several calls in one micro-step (``StepData.merged``)."""
        if names:
            self.warn_once("merged_stats", f"{names}: in step {step} sites were called several times in one micro-step "
                           "(several forwards before one backward, or a module called more than "
                           f"max_calls={self.K} times, whose later calls share its last row); a site statistic of "
                           "your own is not combined across such calls (its over_micro_steps combines micro-steps), "
                           "so those sites have no rows of it. Give each forward its own backward, or raise "
                           "RecorderOptions(max_calls=...). Not reported again.")

    def after(self, step: int, data: StepData, calls: list[int], wants: set[str]) -> None:
        """Raises when no hook fired although backward ran; warns (once each) about a step
        with no backward, sites that saw no call, stacks without cosine rows, norms whose
        gradient is not known, and modules called more often than ``max_calls``."""
        # (a forward under torch.no_grad expects no gradient; a norm's slot marks its w/σ, not a gradient)
        if data.no_backward and (not self.sites_hooked or (data.order[:, : data.grad_sq.shape[1]] > 0).any()):
            traced = not data.blocks["marks"].any()  # the compiled capture marks on the device, eager hooks on the host
            self.warn_once("no_backward", f"step {step} was recorded but no backward inside it reached the recorder's "
                           + ("sites" if self.sites_hooked else "parameters (this Recorder reads no site: a parameter's "
                              "gradient must change in the step and not be all 0.0, as zero_grad(set_to_none=False) "
                              "leaves it)")
                           + ", so it has no gradient rows (act_grad_norm, ln_gain, param_grad_norm, ...): call "
                           "loss.backward() inside `with rec.step(step):` (or before rec.end_step()); or a backward "
                           "given inputs= (loss.backward(inputs=[...])) stopped before every site"
                           + (", which under torch.compile is any backward given inputs=: the compiled capture's "
                              "gradients reach it only through a backward not limited by inputs=" if traced else "")
                           + ". Later steps like this are not reported again.")
        elif 0 < data.backwards < data.grad_forwards:
            self.warn_once("unseen_backward", f"step {step} ran {data.grad_forwards} forwards with grad enabled and the "
                           f"recorder saw {data.backwards} backward(s) reach its sites. Fine if forwards shared a loss "
                           "(as two passes of a contrastive or preference loss do); but a backward given inputs= that "
                           "stopped before every site (under torch.compile: any backward given inputs=) is not seen, "
                           "so the step's gradient rows leave it out and its micro-step merges with the next. Not "
                           "reported again.")
        sites = data.slot_sites()
        if sites is not self._sites_said:  # (the same slots as a step already checked: nothing new to say)
            seen = {p.name for p, c, _, _ in sites if c == 0}
            if not seen:
                if self.awaiting_hooks and self._grads_seen is not None and self._grads_seen.changed():
                    raise RuntimeError(NO_HOOK_FIRED)
                return
            self.ever_seen = True
            self._sites_said = sites
            self._say_silent(step, seen)
        if "cosine" in wants:
            self._cosine(step, data)
        if ("act_grad_norm" in wants or data.user_grads) and not data.no_backward and data.micro_steps:
            self._no_gradient(data)
        lost = sorted(data.grad_left_out - self.warned)
        if lost:
            self.warned.update(lost)
            warnings.warn(f"gradscope: {_listed(lost)} ran on bf16/fp16 tensors; the gradient through a batch or group "
                          "norm alone is computed in closed form, which rounded tensors make inexact, so they have no "
                          "ln_gain or '.in' gradient rows", stacklevel=user_stacklevel())
        low = data.low_precision - data.grad_left_out
        self._names(low, "ran on bf16/fp16 tensors, from which their w/σ cannot be read exactly: they have no "
                    "ln_w_over_sigma rows (their gradient rows are exact)")
        self._names(data.untold - low, "cannot tell their w/σ from their calls: their input is already centred (as "
                    "after another norm), where LayerNorm's and RMSNorm's forms agree, or they name no eps and their "
                    "tokens' variances are nearly equal and below 0.5; so they have no ln_w_over_sigma rows (their "
                    "gradient rows are exact; an `eps` attribute settles the eps, and RMSNorm in the class name the form)")
        self._names(data.guessed - data.unfit, "name no eps, and their tokens' variances are nearly equal (as after "
                    "another norm), so eps cannot be read from the call: their ln_w_over_sigma takes it as 5e-6 "
                    "(within 1e-5 of exact for an eps up to 1e-5); give the module an `eps` attribute to make it exact")
        self._names(data.unfit - data.low_precision - data.untold, "do not map their normalised input to their output "
                    "with one gain per feature (adaptive norms?): their w/σ is not defined, so they have no "
                    "ln_w_over_sigma rows (their gradient rows are exact)")
        over = [p.name for p, n in zip(self.sites, calls) if n > self.K and p.name not in self.warned]
        if over:
            self.warned.update(over)
            warnings.warn(f"gradscope: {_listed(over)} called more than max_calls={self.K} times in one forward; "
                          "later calls are added into the last row (raise max_calls)", stacklevel=user_stacklevel())

    def _say_silent(self, step: int, seen: set[str]) -> None:
        """Warns (once per site) about sites that saw no call in the step."""
        silent = [p.name for p in self.sites if p.name not in seen and p.name not in self.warned]
        if silent:
            self.warned.update(silent)
            warnings.warn(f"gradscope: {len(silent)} site(s) saw no call in step {step} and have no rows: "
                          f"{_listed(silent, 8)} (drop them with sites=...)", stacklevel=user_stacklevel())

    def _no_gradient(self, data: StepData) -> None:
        """Warns about sites called in the step with no gradient: their value never required
        grad, or a backward did not reach them (they then have no row for it, not 0.0)."""
        index = {p.name: i for i, p in enumerate(self.sites)}
        called = (data.order != 0)[:, : data.grad_sq.shape[1]].any(axis=0)
        tapped = (data.order > 0)[:, : data.grad_sq.shape[1]].any(axis=0)
        never, traced = ~data.got.any(axis=0), data.traced_taps
        missed = (data.missed & ~traced).any(axis=0)  # eager: backward did not reach them
        unseen = (data.missed & traced).any(axis=0)  # compiled: the capture did not see that backward
        if not (missed | unseen | (called & ~tapped & never)).any():  # (the usual step: no site to name)
            return
        left_out = {n.site_in for n in self.layout.norms if n.name in data.grad_left_out}  # said already, with the reason
        none, unreached, compiled = set(), set(), set()
        for p, c, slot, site in data.slot_sites():
            if p.name in left_out or not self.grad_expected[index[p.name]]:
                continue
            if missed[slot]:
                unreached.add(site)
            elif unseen[slot]:
                compiled.add(site)
            elif c == 0 and called[slot] and not tapped[slot] and never[slot]:
                none.add(p.name)
        self._names(none, "saw no gradient in a step whose backward ran: the tensor there did not require grad "
                    "(a model input, or a value computed under torch.no_grad), so they have no gradient rows (act_grad_norm, "
                    "the ln_gain of a norm whose input it is, a site_grad quantity's)")
        self._names(unreached, "were called with grad enabled, but a backward of the step did not reach them "
                    "(loss.backward(inputs=...) stopped before them, or their value does not feed that loss): that "
                    "backward gives them no rows, not 0.0 (act_grad_norm, ln_gain, a site_grad quantity's); the step's "
                    "row sums the backwards that reached them")
        self._names(compiled, "ran compiled, and a backward of the step reached other sites but not their compiled "
                    "capture: under torch.compile the capture sees no backward given inputs= (loss.backward(inputs=...)), "
                    "so that backward gives them no rows; run it without inputs= to record them")

    def sharded(self, placements: dict[str, str]) -> None:
        """Names (once each) the sites and norms whose value was a DTensor, left out."""
        shown = sorted({p for n, p in placements.items() if n not in self.warned})
        self._names(set(placements), f"passed on a DTensor (placements {', '.join(shown)}: sequence parallelism, "
                    "each rank holding a slice of the sequence), so they are left out: no rows (act_norm, "
                    "act_grad_norm, ln_gain, ...). Between such modules the slices travel as plain tensors, which "
                    "the recorder cannot tell from whole ones: rows at those sites are each rank's, of its slice")

    def _names(self, norms: set[str], why: str) -> None:
        """One warning naming every norm of ``norms`` not named before, and ``why``."""
        new = sorted(norms - self.warned)
        if new:
            self.warned.update(new)
            warnings.warn(f"gradscope: {_listed(new)} {why}", stacklevel=user_stacklevel())

    def _cosine(self, step: int, data: StepData) -> None:
        written = {k.split(":", 1)[1]: w for k, w in data.blocks.items() if k.startswith("cosine_written:")}
        missing = [st.name for st in self.layout.stacks if not (st.name in written and written[st.name].all())
                   and f"cosine:{st.name}" not in self.warned]
        if missing:
            self.warned.update(f"cosine:{m}" for m in missing)
            warnings.warn(f"gradscope: no cosine rows for stack(s) {missing} in step {step}: not every layer output "
                          "was seen with the stack's feature width (outputs that change width, as a convolutional "
                          "feature encoder's, or a layer that was not called)", stacklevel=user_stacklevel())
        if not self.layout.stacks:
            self.warn_once("cosine", "no cosine rows: the model has no layer stack (an nn.ModuleList of two or more "
                           "blocks of one class; x-transformers alternates attention and feed-forward blocks), "
                           "or sites= left out its outputs")


def _listed(names: list[str], at_most: int = 6) -> str:
    """``[a, b, c]``, or ``[a, b, ...] and 7 more``."""
    return str(names) if len(names) <= at_most else f"{names[:at_most]} and {len(names) - at_most} more"
