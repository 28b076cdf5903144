"""Capture, part 3: saved activations, *measured* by running the forward pass.

The model runs once per sequence length with meta parameters (``functional_call``
swaps in ``empty_like(p, device="meta")`` with the same ``requires_grad``, so
nothing is computed or allocated), under ``torch.autograd.graph.saved_tensors_hooks``.
Forward pre/post hooks on every submodule track the module stack, so each saved
tensor is charged to the innermost layer running when autograd saved it.

Deduplication. A tensor saved by several ops (the norm output read by q, k and v;
a view of it) is one allocation: tensors are keyed by their storage
(``untyped_storage()._cdata``, the address of the C++ ``StorageImpl``, stable
while the tensor lives: the hooks keep every saved tensor alive until the
measurement ends, so no address is reused) and the storage's bytes are charged
once, to the first layer that saves it. ``data_ptr`` is useless on meta (always 0).
Parameters and buffers are excluded (their storages are known up front): they
are model state, not activations.

Root-level tensors. A tensor created outside every submodule and saved by
*several* layers (RoPE tables computed once per forward at the root, then saved
by every block) is charged once, as boundary, to the layer that *created* it by
the nearest-preceding rule (the embedding, for RoPE), not to the first block
that saves it: otherwise block 0 would differ from its identical siblings. A
root-level tensor saved by one layer only (GPT's ``embed + pos_embed`` sum, the
input of block 0's norm) stays with that layer, like any other. Creation is
seen by a ``TorchDispatchMode`` that records the storages each op outputs while
no submodule is running.

Kernel profile ([Note: measured kernels]). Meta and CPU pick different kernels
than a GPU, and those save different tensors: CPU ``dropout`` keeps a mask in the
input dtype (2 bytes in bf16) where CUDA's ``native_dropout`` keeps a ``bool``
mask (1 byte, Korthikanti's assumption); CPU/meta SDPA takes the math path and
saves the full fp32 score matrices, where CUDA's flash kernel saves only
``q, k, v, out`` and the fp32 log-sum-exp. The measurement therefore runs under
``GpuKernelProfile``, a ``TorchFunctionMode`` that routes ``F.dropout`` to
``native_dropout`` and ``F.scaled_dot_product_attention`` to the flash op (the
memory-efficient op when a mask is given), so the tensors autograd saves are
those a GPU run keeps.

Classification (what Megatron TP leaves replicated, see ``LayerInfo``): a tensor
is *boundary* when it is saved in a ``norm`` or ``embedding`` layer, inside a leaf
module whose ``weight`` is not row-parallel or expert (the input of a column,
vocab or replicated linear), or after the layer's row-parallel module returned
(the dropout mask after the output projection); every other tensor is
*interior*. Tensors saved outside every layer go to the last layer that ran
(the first layer, if none ran yet), the rule capture uses for graph nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autoshard.passes._capture_layers import ROOT_LAYER, LayerSpec

_BOUNDARY_KINDS = ("norm", "embedding")
_INTERIOR_ROLES = ("row", "expert")


@dataclass(frozen=True)
class SavedBytes:
    """Bytes one layer saves for backward at one (batch, sequence) point."""

    boundary: int = 0
    interior: int = 0


class GpuKernelProfile(TorchFunctionMode):
    """Route dropout and SDPA to the kernels a GPU runs (see [Note: measured kernels])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.dropout, torch.dropout):
            return _native_dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return _fused_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _native_dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not query.is_meta:  # the real-device fallback keeps that device's own kernel choice
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    # enable_gqa needs nothing here: the fused ops' meta kernels accept fewer kv heads,
    # and they save k and v unexpanded, as the GPU kernels do.
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, scale=scale
        )[0]
    bias = attn_mask
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
        bias = bias.masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale
    )[0]


@dataclass
class _Saved:
    """One saved storage: its bytes, class and first saver, and every layer that saved it."""

    nbytes: int
    cls: str
    first: LayerSpec | None  # None: saved before any layer ran (charged to the first layer)
    savers: set[str] = field(default_factory=set)


class _Recorder:
    """Module stack + saved-tensor bookkeeping for one forward pass."""

    def __init__(self, layers: list[LayerSpec], weight_roles: dict[int, str], excluded: set[int]):
        self.layers = layers
        self.layer_of = {id(spec.module): spec for spec in layers if spec.name != ROOT_LAYER}
        self.weight_roles = weight_roles
        self.excluded = excluded
        self.stack: list[nn.Module] = []
        self.last_layer: LayerSpec | None = None
        self.first_layer: LayerSpec | None = None
        self.after_row: set[str] = set()
        self.saved: dict[int, _Saved] = {}  # storage address → record
        self.keep: list[torch.Tensor] = []  # keeps saved storages (and their addresses) alive
        self.root_created: dict[int, LayerSpec | None] = {}  # storage → layer that ran last before it was made

    def created(self, outputs: list[torch.Tensor]) -> None:
        """Record storages made while no submodule runs (see "Root-level tensors")."""
        if self.stack:
            return
        for t in outputs:
            self.root_created.setdefault(t.untyped_storage()._cdata, self.last_layer)
            self.keep.append(t)

    def pre(self, module: nn.Module, args) -> None:
        self.stack.append(module)
        spec = self.layer_of.get(id(module))
        if spec is not None:
            self.after_row.discard(spec.name)
            self.last_layer = spec
            self.first_layer = self.first_layer or spec

    def post(self, module: nn.Module, args, output) -> None:
        popped = self.stack.pop()
        assert popped is module, "module hooks out of order"
        if self.weight_roles.get(id(module)) == "row" and self.last_layer is not None:
            self.after_row.add(self.last_layer.name)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.excluded:
            return tensor
        spec = self._current_layer()
        if key not in self.saved:
            self.saved[key] = _Saved(storage.nbytes(), self._classify(spec), spec)
            self.keep.append(tensor)
        self.saved[key].savers.add(spec.name if spec is not None else "")
        return tensor

    def totals(self) -> dict[str, SavedBytes]:
        """Bytes per layer: each storage once, to its first saver, or to its creator when it is a
        root-level tensor saved by several layers (then boundary: such tensors are not TP-sharded)."""
        out = {spec.name: [0, 0] for spec in self.layers}
        for key, record in self.saved.items():
            layer, cls = record.first, record.cls
            if key in self.root_created and len(record.savers) > 1:
                layer, cls = self.root_created[key], "boundary"
            layer = layer or self.first_layer
            assert layer is not None, "a tensor was saved but no layer ever ran"
            out[layer.name][0 if cls == "boundary" else 1] += record.nbytes
        return {name: SavedBytes(b, i) for name, (b, i) in out.items()}

    def _current_layer(self) -> LayerSpec | None:
        for module in reversed(self.stack):
            spec = self.layer_of.get(id(module))
            if spec is not None:
                return spec
        return self.last_layer

    def _classify(self, spec: LayerSpec | None) -> str:
        if spec is None or spec.kind in _BOUNDARY_KINDS or spec.name in self.after_row:
            return "boundary"
        role = self.weight_roles.get(id(self.stack[-1])) if self.stack else None
        if role is not None and role not in _INTERIOR_ROLES:
            return "boundary"
        return "interior"


def measure_saved(
    model: nn.Module,
    layers: list[LayerSpec],
    weight_roles: dict[int, str],
    inputs: tuple,
    on_meta: bool = True,
) -> dict[str, SavedBytes]:
    """Saved-for-backward bytes per layer for one forward pass on ``inputs``.

    With ``on_meta`` the parameters, buffers and tensor inputs are replaced by
    meta tensors (nothing computed); otherwise the model runs for real on its
    own device (the fallback for models that cannot run on meta). The model must
    already be in training mode.
    """
    state = _meta_state(model) if on_meta else {}
    excluded = {t.untyped_storage()._cdata for t in state.values()}
    excluded |= {t.untyped_storage()._cdata for t in _model_tensors(model)}
    recorder = _Recorder(layers, weight_roles, excluded)
    handles = _install_hooks(model, recorder)
    args = tuple(_to_meta(a) for a in inputs) if on_meta else inputs
    try:
        with (
            GpuKernelProfile(),
            _CreationTracker(recorder),
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t),
        ):
            output = functional_call(model, state, args) if on_meta else model(*args)
        del output
    finally:
        for handle in handles:
            handle.remove()
    return recorder.totals()


def _meta_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        state[name] = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
    for name, b in model.named_buffers():
        state[name] = torch.empty_like(b, device="meta")
    return state


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    return value


class _CreationTracker(TorchDispatchMode):
    """Tells the recorder which storages each op creates (below autograd, so every aten op)."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.recorder.created([t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def _install_hooks(model: nn.Module, recorder: _Recorder) -> list[Callable]:
    """Pre/post forward hooks on every submodule (the root excluded: "no module running" = root level)."""
    handles = []
    for module in model.modules():
        if module is model:
            continue
        handles.append(module.register_forward_pre_hook(recorder.pre))
        handles.append(module.register_forward_hook(recorder.post, always_call=True))
    return handles
