"""The hook functions of one recorded step.

A :class:`StepHooks` lives for one ``Recorder.step`` context. Forward hooks put 0-d norms
on the device buffer and register tensor hooks on each site's value, so the recorded
gradient is ∂loss/∂h for that tensor h (all its uses summed). The recorder never alters the
graph (no inserted ops, no returned replacements), so training with it is bit-identical.

``ln_gain`` needs the gradient that flows back *through the norm alone*; in Pre-LN the norm
input is also the residual stream, whose total gradient is larger. For PyTorch's fused
LayerNorm, a hook on the norm's own autograd node reads it (``grad_inputs[0]``) for free.
For other norms (RMSNorm, ScaleNorm, HuggingFace's T5LayerNorm), when the gradient of the
norm's output arrives, the hook takes the vector-Jacobian product of the norm at its saved
input with that gradient (one extra small backward through the norm, no ``.grad`` written).
The norm of the output gradient is shared with any site on the norm's output, and
``ln_w_over_sigma`` reads 1/σ from the ``rstd`` the fused LayerNorm saved for backward.

Activation checkpointing re-runs forward hooks during backward. Forward statistics are
taken once per (micro-step, site); a gradient hook is registered once, on the first value
that requires grad (the original forward for non-reentrant checkpointing, the recompute
for reentrant checkpointing, whose first pass runs under ``no_grad``). Nothing calls
``.item()``.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradscope.models.norms import ScaleNorm
from gradscope.recorder.layout import Layout, NormProbe, Probe
from gradscope.recorder.store import StepBuffer


FUSED_NORM_NODES = frozenset({"NativeLayerNormBackward0"})


def _norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32)


def w_over_sigma(module: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor | None:
    """mean over tokens and features of w_f/σ_t, σ_t what the norm divides token t by (Xu 2020 Table 2).

    LayerNorm: σ = sqrt(Var(x) + eps); RMSNorm: σ = sqrt(mean(x²) + eps). Other norms: None.
    When ``y`` (the LayerNorm's output) carries PyTorch's fused LayerNorm node, 1/σ is the
    ``rstd`` that node saved for backward: read, not recomputed. It is not read while a
    saved-tensor hook is active (non-reentrant checkpointing, offloading), where reading a
    saved tensor could unpack or recompute it.
    """
    weight = getattr(module, "weight", None)
    if weight is None or not isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return None
    w_mean = weight.detach().float().mean()
    node = getattr(y, "grad_fn", None)
    if isinstance(module, nn.LayerNorm) and type(node).__name__ in FUSED_NORM_NODES and not _saved_tensor_hooks_active():
        rstd = node._saved_result2  # native_layer_norm's rstd = 1/sqrt(Var + eps), per token
        if rstd.dtype in (torch.float32, torch.float64):  # a bf16/fp16 rstd (CPU, low-precision input) is recomputed
            return w_mean * rstd.float().mean()
    dims = tuple(range(-len(module.normalized_shape), 0))  # σ over the normalised dimensions, as the norm takes it
    x = x.detach().float()
    if isinstance(module, nn.LayerNorm):
        sigma = torch.sqrt(x.var(dim=dims, unbiased=False) + module.eps)
    else:
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        sigma = torch.sqrt(x.pow(2).mean(dim=dims) + eps)
    return w_mean * sigma.reciprocal().mean()


def _saved_tensor_hooks_active() -> bool:
    """Whether a ``saved_tensors_hooks`` context is open (True when it cannot be told)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(True) is not None


def _first_tensor(value) -> torch.Tensor | None:
    """A hook value's tensor: the value itself, or the first item of a tuple/list."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _input_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A module's main input: its first positional tensor, or HuggingFace's ``hidden_states``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


class StepHooks:
    """Installs and runs the hooks of one recorded step.

    Args:
        model: the recorded model.
        layout: its sites and norms.
        buffer: where values go.
        wants: the quantity names to compute this step.
        cosine_tokens: tokens sampled per stack for the cosine matrix.
        generator: CPU generator for token sampling (never the global RNG).
        token_masks: callable giving stack name → (B, T) bool mask for one forward's inputs.
    """

    def __init__(self, model, layout: Layout, buffer: StepBuffer, wants: set[str], cosine_tokens: int,
                 generator: torch.Generator, token_masks: Callable) -> None:
        self.model, self.layout, self.buf, self.wants = model, layout, buffer, wants
        self.cosine_tokens, self.generator, self.token_masks = cosine_tokens, generator, token_masks
        self.micro = -1
        self.fired: set[tuple[int, str]] = set()
        self.hooked: set[tuple[int, str]] = set()
        self.handles: list = []
        self.tensor_handles: list = []
        self.recent_grads: collections.deque = collections.deque(maxlen=2)
        self.masks: dict[str, torch.Tensor | None] = {}
        self.samples: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # stack -> (idx, weights)
        self.cosine_rows: dict[str, dict[int, torch.Tensor]] = {}
        self.tensors: dict[tuple[int, int], dict] = {}  # (micro, id(tensor)) -> shared norm and grad keys
        self.active = True
        self._cosine_site = {s: (st.name, i) for st in layout.stacks for i, s in enumerate(st.sites)}
        self.wants_cosine = "cosine" in wants
        self.forward_stats = bool(wants & {"act_norm", "nonfinite"})
        self.grad_stats = bool(wants & {"act_grad_norm", "nonfinite"})

    # -- installation ------------------------------------------------------------------
    def install(self) -> None:
        """Registers every module hook of this step."""
        self.handles.append(self.model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        for probe in self.layout.probes:
            if probe.where == "output":
                self.handles.append(probe.module.register_forward_hook(self._output_hook(probe)))
            else:
                self.handles.append(probe.module.register_forward_pre_hook(self._input_hook(probe), with_kwargs=True))
        if "ln_w_over_sigma" in self.wants:
            for norm in self.layout.norms:
                self.handles.append(norm.module.register_forward_hook(self._w_sigma_hook(norm)))
        if "ln_gain" in self.wants:
            for norm in self.layout.norms:
                self.handles.append(norm.module.register_forward_hook(self._ln_gain_hook(norm)))

    def remove(self) -> None:
        """Removes every module and tensor hook; later firings of stale hooks are ignored."""
        self.active = False
        for h in self.handles + self.tensor_handles:
            h.remove()
        self.handles.clear()
        self.tensor_handles.clear()
        self.recent_grads.clear()

    # -- hooks ---------------------------------------------------------------------------
    def _root_pre(self, module, args, kwargs):
        if not self.active:
            return None
        self.micro += 1
        self.recent_grads.clear()  # no gradient of the last backward is held through this forward
        if "cosine" in self.wants and self.micro == 0:
            self.masks = self.token_masks(args, kwargs)
        return None

    def _shared(self, value: torch.Tensor) -> dict:
        """Per-tensor state for this micro-step: several sites often see one tensor (a Post-LN
        ``sum`` is its ``norm.in``; a layer's ``out`` is the next layer's ``in``), and they
        share one forward norm and one gradient hook."""
        slot = (self.micro, id(value))
        entry = self.tensors.get(slot)
        if entry is None or entry["ref"]() is not value:  # ids of freed tensors are reused
            entry = self.tensors[slot] = {"ref": weakref.ref(value), "norm": None, "grad_keys": [], "hooked": False}
        return entry

    def _observe(self, probe: Probe, value: torch.Tensor) -> None:
        """Forward statistics and the gradient hook for one site value."""
        key = (self.micro, probe.name)
        entry = self._shared(value)
        if key not in self.fired:
            self.fired.add(key)
            if self.forward_stats:
                if entry["norm"] is None:
                    entry["norm"] = _norm(value)
                self.buf.add((self.micro, probe.stack, probe.layer, probe.name, "act_norm", None), entry["norm"])
            if self.micro == 0 and self.wants_cosine and probe.name in self._cosine_site:
                self._capture_cosine(probe.name, value)
        if self.grad_stats and value.requires_grad and key not in self.hooked:
            self.hooked.add(key)
            self._want_grad(entry, value, (self.micro, probe.stack, probe.layer, probe.name, "act_grad_norm", None))

    def _want_grad(self, entry: dict, value: torch.Tensor, key) -> None:
        """Records ‖∂loss/∂value‖ under ``key``; one norm and one hook per tensor, whatever
        the number of keys (sites, a norm's ``__ln_out__``) that ask for it."""
        entry["grad_keys"].append(key)
        if entry["hooked"]:
            return
        entry["hooked"] = True
        keys = entry["grad_keys"]  # later keys on the same tensor join this list before backward

        def on_grad(grad: torch.Tensor) -> None:
            if self.active:
                self.buf.add_shared(keys, self._grad_norm(grad))

        self.tensor_handles.append(value.register_hook(on_grad))

    def _grad_norm(self, grad: torch.Tensor) -> torch.Tensor:
        """‖grad‖, reusing the norm when backward hands the very same gradient tensor to two
        hooks in a row (a residual ``sum`` and its ``branch``; a Post-LN ``sum`` and its norm's
        input gradient). The last two gradients are held, so their memory is not reused
        while compared; they are let go at the next forward and at the end of the step."""
        for seen, version, norm in self.recent_grads:
            if seen is grad and seen._version == version:
                return norm
        norm = _norm(grad)
        self.recent_grads.append((grad, grad._version, norm))
        return norm

    def _output_hook(self, probe: Probe):
        def hook(module, args, output):
            tensor = _first_tensor(output)
            if self.active and tensor is not None:
                self._observe(probe, tensor)

        return hook

    def _input_hook(self, probe: Probe):
        def hook(module, args, kwargs):
            tensor = _input_tensor(args, kwargs)
            if self.active and tensor is not None:
                self._observe(probe, tensor)

        return hook

    def _ln_gain_hook(self, norm: NormProbe):
        """Forward hook on a norm: ‖grad in‖ through the norm alone, and ‖grad out‖ (shared
        with a site on the norm's output when there is one)."""

        def hook(module, args, output):
            x, y = _input_tensor(args, {}), _first_tensor(output)
            key = (self.micro, f"gain:{norm.name}")
            if not self.active or x is None or y is None or not y.requires_grad or key in self.hooked:
                return
            self.hooked.add(key)
            key_in = (self.micro, norm.stack, norm.layer, norm.name, "__ln_in__", None)
            self._want_grad(self._shared(y), y, (self.micro, norm.stack, norm.layer, norm.name, "__ln_out__", None))
            node = y.grad_fn
            if type(node).__name__ in FUSED_NORM_NODES:  # its grad_inputs[0] is the gradient through the norm alone

                def on_node(grad_inputs, grad_outputs) -> None:
                    if self.active and grad_inputs[0] is not None:
                        self.buf.add(key_in, self._grad_norm(grad_inputs[0]))

                self.tensor_handles.append(node.register_hook(on_node))
                return
            x = x.detach()

            def on_grad(grad: torch.Tensor) -> None:
                if not self.active:
                    return
                with torch.enable_grad():
                    xx = x.requires_grad_()
                    (grad_in,) = torch.autograd.grad(_first_tensor(module.forward(xx)), xx, grad)
                self.buf.add(key_in, _norm(grad_in))

            self.tensor_handles.append(y.register_hook(on_grad))

        return hook

    def _w_sigma_hook(self, norm: NormProbe):
        """Forward hook on a norm: w/σ, σ read from LayerNorm's saved 1/σ when autograd kept it."""

        def hook(module, args, output):
            if not self.active or not args or not isinstance(args[0], torch.Tensor):
                return None
            key = (self.micro, f"wsig:{norm.name}")
            if key in self.fired:
                return None
            self.fired.add(key)
            value = w_over_sigma(module, args[0], _first_tensor(output))
            if value is not None:
                self.buf.add((self.micro, norm.stack, norm.layer, norm.name, "ln_w_over_sigma", None), value)
            return None

        return hook

    # -- cosine --------------------------------------------------------------------------
    def _capture_cosine(self, site: str, value: torch.Tensor) -> None:
        stack, i = self._cosine_site[site]
        flat = value.detach().reshape(-1, value.shape[-1])  # (B*T, d)
        if stack not in self.samples:
            n = flat.shape[0]
            idx = torch.randperm(n, generator=self.generator)[: self.cosine_tokens].to(flat.device)
            mask = self.masks.get(stack)
            if mask is not None and mask.numel() == n:
                weights = mask.reshape(-1).to(flat.device)[idx].float()
            else:
                weights = torch.ones(idx.shape[0], device=flat.device)
            self.samples[stack] = (idx, weights)
        idx, _ = self.samples[stack]
        self.cosine_rows.setdefault(stack, {})[i] = flat[idx].float()  # (K, d)

    def cosine_matrices(self) -> dict[str, torch.Tensor]:
        """Stack → S[i, j] = weighted mean over sampled non-pad tokens of cos(y_i[t], y_j[t]) (Takase Fig. 5)."""
        out = {}
        for stack, rows in self.cosine_rows.items():
            n = len(next(s for s in self.layout.stacks if s.name == stack).sites)
            if sorted(rows) != list(range(n)):
                continue
            Y = F.normalize(torch.stack([rows[i] for i in range(n)]), dim=-1)  # (L+1, K, d)
            w = self.samples[stack][1]
            out[stack] = torch.einsum("ikd,jkd,k->ij", Y, Y, w) / w.sum().clamp_min(1.0)
        return out


def scalenorm_gains(layout: Layout) -> list[tuple[NormProbe, torch.Tensor]]:
    """(norm, g) for every ScaleNorm."""
    return [(n, n.module.g.detach()) for n in layout.norms if isinstance(n.module, ScaleNorm)]
