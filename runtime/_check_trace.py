"""What one rank's program issues and holds under fake tensors: the dispatch mode of ``autoshard/check.py``.

``Trace`` is a ``LiveBytes`` (``autoshard/live_bytes.py``) that counts meta
storages and, beside the bytes, records every collective the program issues,
as the dispatcher sees it:

| op namespace | seen as | group from |
| --- | --- | --- |
| ``autoshard::`` (``kernels/collectives.py``, ``async_collectives.py``, ``quantized_collectives.py``) | the op, forward and backward (under a dispatch mode the eager fast path is off, so every call dispatches) | its group-name argument |
| ``c10d::`` (``torch.distributed`` calls: pipeline send/recv, broadcast) | the op | its ``ProcessGroup`` argument |
| ``_c10d_functional::`` (compiled forms, ``kernels/traced_collectives.py``) | the op | its group-name argument |

On meta tensors a custom op runs its fake kernel, so an ``autoshard::`` op is
recorded once, at its own level (it issues no ``c10d::`` op underneath).

Per collective the record is ``Issued(kind, axis, nbytes, peer)``: the kind
(``KINDS`` maps op names; an op not in the table keeps its own name, so it
must still match across ranks), the mesh axis its group serves (group names
differ between ranks; the axis does not), the bytes of its tensor inputs (what
each rank contributes: equal across a group for every kind but ``all_to_all``,
whose splits follow the routing, so its bytes are not compared) and, for
send/recv, the peer's coordinate on the group's axis. Ops that move nothing
(the forward of Megatron's ``f`` and of ``scatter_to_sp``, the wait of an
asynchronous gather) are not collectives here; their backward ops are.

Kernels: on the meta device ``scaled_dot_product_attention`` takes the math path (its
``_fused_sdp_choice`` is 0 there), which materialises the fp32 ``[b, a, s, s]`` scores,
their softmax and its gradient, where the CPU (``_scaled_dot_product_flash_attention_for_cpu``)
and CUDA (flash) run a fused kernel that saves only ``out`` and the fp32 log-sum-exp. At
``s = 4096`` that is 16 GiB a tensor for a Llama-70B layer at tp 2, 8 sequences: the trace
would report a peak no device has. ``route_device_kernels`` points the built program's SDPA nodes at
the flash op on meta tensors, as capture measures saved activations (``passes/_capture_saved.
GpuKernelProfile``), so the trace and the cost model see the kernel a device runs.

A meta tensor has no values: ``aten._local_scalar_dense`` (``float(t)``,
``t.item()``, ``t.tolist()``) answers 1 (1.0 for floating dtypes), so a
training step runs to its end; a data-dependent size (expert routing without
a capacity factor) is then the size it would have with every count 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from autoshard.passes._capture_saved import _fused_sdpa
from autoshard.live_bytes import LiveBytes

# op name (without overload) → collective kind; None: moves nothing (see module docstring)
KINDS: dict[str, str | None] = {
    "autoshard.all_gather": "all_gather",
    "autoshard.all_gather_start": "all_gather",
    "autoshard.all_gather_wait": None,
    "autoshard.gather_from_sp": "all_gather",
    "autoshard.quantized_all_gather": "all_gather",
    "autoshard.reduce_scatter": "reduce_scatter",
    "autoshard.quantized_reduce_scatter": "reduce_scatter",
    "autoshard.all_reduce": "all_reduce",
    "autoshard.reduce_from_tp": "all_reduce",
    "autoshard.copy_to_tp": None,
    "autoshard.scatter_to_sp": None,
    "autoshard.all_to_all": "all_to_all",
    "c10d.allreduce_": "all_reduce",
    "c10d.allgather_": "all_gather",
    "c10d._allgather_base_": "all_gather",
    "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "c10d.reduce_scatter_": "reduce_scatter",
    "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d.alltoall_": "all_to_all",
    "c10d.alltoall_base_": "all_to_all",
    "c10d.broadcast_": "broadcast",
    "c10d.send": "send",
    "c10d.recv_": "recv",
    "c10d.barrier": "barrier",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.all_reduce": "all_reduce",
    "_c10d_functional.all_to_all_single": "all_to_all",
    "_c10d_functional.wait_tensor": None,
}
_NAMESPACES = ("autoshard.", "c10d.", "_c10d_functional.")
# when one process group serves several axes (a small mesh), the first of these names it
AXIS_PREFERENCE = ("tp", "cp", "dp_shard", "dp_replicate", "dp", "ep", "edp", "pp", "world")
_UNSIZED = frozenset({"all_to_all"})
_P2P = frozenset({"send", "recv"})


@dataclass(frozen=True)
class Issued:
    """One collective as one rank issued it (module docstring). ``nbytes`` is ``None`` where not compared."""

    kind: str
    axis: str
    nbytes: int | None
    peer: int | None = None  # send/recv: the other rank's coordinate on ``axis``

    def __str__(self) -> str:
        size = "" if self.nbytes is None else f" {format_bytes(self.nbytes)}"
        peer = "" if self.peer is None else f" with {self.axis} {self.peer}"
        return f"{self.kind} on group {self.axis}{size}{peer}"


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number ≥ 1 (``4.0 MiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


class Trace(LiveBytes):
    """Live meta bytes (``LiveBytes``) and the collectives issued while active (module docstring).

    ``axes``: this rank's group name → mesh axis (``axis_of_groups``); ``collectives`` grows as ops run.
    """

    def __init__(self, axes: dict[str, str]) -> None:
        super().__init__(count_meta=True)
        self.axes = axes
        self.collectives: list[Issued] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return 1.0 if args[0].dtype.is_floating_point else 1
        name = func._schema.name.replace("::", ".")  # without the overload
        if name.startswith(_NAMESPACES):
            self._record(name, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        kind = KINDS.get(name, name)
        if kind is None:
            return
        flat = tree_flatten((args, kwargs))[0]
        group = next((g for g in map(_group_name, flat) if g is not None and g in self.axes), None)
        axis = self.axes.get(group, "?") if group is not None else "?"
        nbytes = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        peer = None
        if kind in _P2P:  # c10d.send(tensors, pg, dst, tag) / recv_(tensors, pg, src, tag): group-local rank
            peer = args[2]
        self.collectives.append(Issued(kind, axis, None if kind in _UNSIZED else nbytes, peer))


SDPA = torch.ops.aten.scaled_dot_product_attention.default


def device_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """``aten.scaled_dot_product_attention`` as a CPU or CUDA device runs it: on meta tensors the fused (flash)
    op, elsewhere the op itself (module docstring, Kernels)."""
    return _fused_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def route_device_kernels(module: torch.nn.Module) -> int:
    """Point every ``aten.scaled_dot_product_attention`` node of the graph modules under ``module`` (checkpoint
    regions included) at ``device_sdpa``; the number of nodes changed. A function mode cannot do it: it is
    off while ``loss.backward()`` runs, where full recompute re-runs the forward."""
    changed = 0
    for sub in module.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        nodes = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is SDPA]
        for node in nodes:
            node.target = device_sdpa
        if nodes:
            sub.recompile()
            changed += len(nodes)
    return changed


def _group_name(value) -> str | None:
    """The group name a collective's argument designates: a name string or a ``ProcessGroup`` script object."""
    if isinstance(value, str):
        return value
    if isinstance(value, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(value).group_name
        except (RuntimeError, AttributeError):
            return None
    return None


def axis_of_groups(group_names: dict[str, str]) -> dict[str, str]:
    """group name → the axis it serves (``AXIS_PREFERENCE`` where one group serves several)."""
    out: dict[str, str] = {}
    for axis in sorted(group_names, key=lambda a: AXIS_PREFERENCE.index(a) if a in AXIS_PREFERENCE else 99):
        out.setdefault(group_names[axis], axis)
    return out


__all__ = ["AXIS_PREFERENCE", "Issued", "KINDS", "Trace", "axis_of_groups", "device_sdpa", "format_bytes", "route_device_kernels"]
