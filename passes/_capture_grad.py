"""Capture, part 4: the backward's working set per layer, *measured* by a forward and backward pass on meta.

A layer's backward holds more than the saved activations of the layers before it and the gradients of
the layers after it, which the cost model prices already: the gradient of its output (and of the
residual stream beside it), the activation gradients it computes inside (an RMSNorm's fp32 copies, the
``[T, ffn]`` gradients of a SwiGLU MLP, a dropless MoE's ``[E, T, ·]`` buffers) and, part way through,
some of its own parameters' gradients. This is that working set, ``W``.

Measurement. The model runs forward and backward once, at the capture's longer sequence, with meta
parameters (nothing computed or allocated) and the GPU kernel profile of ``_capture_saved``, under a
``LiveBytes`` dispatch mode that counts every storage an op creates until it is freed. The backward is
of the sum of the model's floating outputs (a broadcast of ones: the loss's own logits gradient is the
cost model's ``loss_bytes``, not a layer's). A layer's window runs from its backward pre-hook (the
gradient of its output exists) to the next layer's; the loss's backward belongs to the first window.
Within layer ``i``'s window, after every op::

    Δ(t) = live(t) − Gr(t) − F_i

``live`` every counted storage (forward tensors still saved, gradients, activation gradients), ``Gr(t)``
the parameter gradients created so far (every layer's, this one's included: a gradient is charged from
the op that creates it, before autograd accumulates it), ``F_i`` the forward's storages still alive when
the window opens (the saved activations of layers ≤ i). So ``Δ`` counts the activation gradients live,
less the layer's saved activations its backward has freed. Recorded per layer, per token of the
measurement (``b·s₂``):

    W   = max_t Δ(t)                        ``LayerInfo.grad_working_per_token``
    f   = Gr_i(t*) / Gr_i                   ``LayerInfo.grad_working_param_fraction``: the share of the
                                            layer's own gradient bytes created by the peak t*
    end = Δ at the window's last op         ``LayerInfo.grad_working_end_per_token`` (its input's gradient,
                                            less what the layer freed: negative when it freed more)

``search/layer_terms.backward_working_bytes`` turns them into the layer's backward buffers.

Limits: one measurement point, so a term that grows with ``s²`` (attention scores; none with the flash
kernel profile) is charged per token at ``s₂``; a model that cannot run backward on meta (or whose
output has no floating tensor) records zeros and is logged, as the cost model priced it before.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

from autoshard.live_bytes import LiveBytes
from autoshard.passes._capture_layers import ROOT_LAYER, LayerSpec
from autoshard.passes._capture_saved import GpuKernelProfile

log = logging.getLogger("autoshard.capture")


@dataclass(frozen=True)
class GradWorking:
    """One layer's backward working set at one (batch, sequence) point, bytes (module docstring)."""

    peak: int = 0  # W
    param_fraction: float = 0.0  # f
    end: int = 0


class _Timeline(LiveBytes):
    """``LiveBytes`` on meta that records, after every op of the backward, what the windows need."""

    def __init__(self) -> None:
        super().__init__(count_meta=True)
        self.backward = False
        self.op = 0
        self.created_at: dict[int, int] = {}  # storage → op index that created it
        self.forward_keys: set[int] = set()
        self.forward_live = 0
        self.window: str | None = None  # the layer whose backward runs (None: before the first pre-hook)
        self.rows: list[tuple[int, str | None, int, int]] = []  # (op, window, live, forward_live)

    def _count(self, tensor: torch.Tensor) -> None:
        before = self.live
        super()._count(tensor)
        if self.live != before:
            key = tensor.untyped_storage()._cdata
            self.created_at[key] = self.op
            if not self.backward:
                self.forward_keys.add(key)
                self.forward_live += self.live - before

    def _drop(self, key: int) -> None:
        if key in self.forward_keys:
            self.forward_keys.discard(key)
            self.forward_live -= self._sizes.get(key, 0)
        super()._drop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.backward:
            self.rows.append((self.op, self.window, self.live, self.forward_live))
        self.op += 1
        return out

    def open(self, layer: str) -> None:
        """A layer's backward starts: its window opens (the rows record which)."""
        self.window = layer
        self.rows.append((self.op, layer, self.live, self.forward_live))


def measure_grad_working(model: nn.Module, layers: list[LayerSpec], inputs: tuple) -> dict[str, GradWorking]:
    """Per layer, the backward's working set for one forward and backward on ``inputs`` (module docstring).
    The model runs on meta (its parameters replaced) and must be in training mode."""
    # a tied parameter gets one tensor per name, untied: tied, autograd holds the first use's gradient until
    # the last use's backward (the head's until the embedding's), which would be charged to every layer
    # between; it is the owning layer's gradient, priced as such (``tie_weights=False`` below)
    state = {name: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
             for name, p in model.named_parameters(remove_duplicate=False)}
    state.update({name: torch.empty_like(b, device="meta") for name, b in model.named_buffers()})
    owner = _param_owner(model, layers)
    layer_of = {id(spec.module): spec.name for spec in layers if spec.name != ROOT_LAYER}
    timeline = _Timeline()
    grads: dict[int, tuple[str, int]] = {}  # storage of a parameter's gradient → (owning layer, bytes)

    def accumulated(name: str):
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:
                grads[param.grad.untyped_storage()._cdata] = (owner.get(name, ""), param.grad.untyped_storage().nbytes())
        return hook

    handles = [state[name].register_post_accumulate_grad_hook(accumulated(name))
               for name in state if state[name].requires_grad]
    for module in model.modules():
        if id(module) in layer_of:
            handles.append(module.register_full_backward_pre_hook(
                lambda mod, grad_out, name=layer_of[id(module)]: timeline.open(name)))
    args = tuple(torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in inputs)
    try:
        with GpuKernelProfile(), timeline, warnings.catch_warnings():
            # the embedding's pre-hook fires though no input needs a gradient, which is what the window needs
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            output = functional_call(model, state, args, tie_weights=False)
            floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()
                      and t.requires_grad]
            if not floats:
                log.warning("capture: no floating output needs a gradient; backward working set not measured")
                return {}
            loss = sum(t.sum() for t in floats)
            del output, floats
            timeline.backward = True
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return _windows(timeline, grads, owner, layers)


def _param_owner(model: nn.Module, layers: list[LayerSpec]) -> dict[str, str]:
    """Parameter FQN (as ``named_parameters`` gives it) → the innermost layer whose module holds it."""
    by_id: dict[int, str] = {}
    for spec in sorted(layers, key=lambda s: s.name.count(".")):  # deeper layers last: they win
        if spec.name == ROOT_LAYER:
            continue
        for p in spec.module.parameters(recurse=not spec.direct_only):
            by_id[id(p)] = spec.name
    return {name: by_id.get(id(p), "") for name, p in model.named_parameters(remove_duplicate=False)}


def _windows(timeline: _Timeline, grads: dict[int, tuple[str, int]], owner: dict[str, str],
             layers: list[LayerSpec]) -> dict[str, GradWorking]:
    """The module docstring's W, f and end per layer, from the recorded rows."""
    created = sorted((timeline.created_at[key], layer, size) for key, (layer, size) in grads.items()
                     if key in timeline.created_at)
    own_total: dict[str, int] = {}
    for _, layer, size in created:
        own_total[layer] = own_total.get(layer, 0) + size
    out: dict[str, list] = {}
    first = next((w for _, w, _, _ in timeline.rows if w is not None), None)
    index = all_grads = 0
    own: dict[str, int] = {}
    current, opened = None, 0
    for op, window, live, forward_live in timeline.rows:
        while index < len(created) and created[index][0] <= op:
            _, layer, size = created[index]
            all_grads += size
            own[layer] = own.get(layer, 0) + size
            index += 1
        window = window or first
        if window is None:
            continue
        if window != current:  # a window opens: the forward's storages alive now are the layers ≤ i's
            current, opened = window, forward_live
        delta = live - all_grads - opened
        record = out.setdefault(window, [delta, 0.0, delta])
        if delta > record[0]:
            record[0], record[1] = delta, own.get(window, 0) / own_total[window] if own_total.get(window) else 0.0
        record[2] = delta
    names = {spec.name for spec in layers}
    return {name: GradWorking(max(int(peak), 0), fraction, int(end)) for name, (peak, fraction, end) in out.items()
            if name in names}
