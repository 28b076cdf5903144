"""Capture pass: ``torch.export`` → ``ModelGraph``, the first pass and the entry of autoshard.

Pre-condition: ``model(*example_inputs)`` (or ``model(**example_inputs)`` for a
dict) runs, the first input is tokens ``[B, S]`` (dim 0 batch, dim 1 sequence),
any other tensor input is ``[B, ...]`` or broadcast over the batch
(``_capture_inputs``, [Note: model inputs]: masks, position and segment ids),
and the model's forward is traceable by ``torch.export.export(..., strict=False)``. Post-condition: a ``ModelGraph``
whose layers partition the model's parameters (tied ones counted once), in
execution order, with forward FLOPs, bytes and *measured* saved activations.
The model is left as it was (training flags restored, hooks removed).

Steps:

1. Layers (``_capture_layers``): module instances at the strategy granularity
   (embedding, each block's norms, attention, MLP/MoE, final norm, heads), their
   parameters, TP roles and shape metadata.
2. Export (training IR, nothing decomposed) with ``Dim.AUTO`` on every dim of
   every tensor input, at the longer sequence ``s2``. Node → layer attribution:
   a node belongs to the deepest module of ``node.meta["nn_module_stack"]``
   that is a layer; a node with no layer in its stack (root-level ``arange``,
   RoPE tables, the residual adds of ``blocks.i``, the final ``squeeze``) goes
   to the layer of the nearest *preceding* node in graph order, or to the
   first layer when it precedes every layer node. A deep stack of
   verified-identical blocks is exported as a three-block proxy and expanded
   (``_capture_proxy``: the checks, and why this is exact); ``export_all_blocks``
   turns that off. Layers the names left ``other`` whose projections form
   attention (around SDPA) or an MLP in the exported graph's dataflow take
   that kind, Megatron roles and head / FFN counts (``_capture_blocks``: a
   hand-written nanoGPT or Llama block); a width-1 projection on the final
   norm's output that reaches a model output takes kind ``value_head``, and a
   layer whose module returns no batch dim (a positional table looked up at
   ``arange(S)``) is marked ``batch_free_output``. The roles are final only
   now, so the saved-activation measurement below follows this step.
3. Costs (``_capture_costs``): FLOPs and activation bytes per node from the
   symbolic shapes evaluated at ``(b, s1)`` and ``(b, s2)`` (the sequence symbol
   substituted, so one dynamic export serves both points). When the sequence
   dim was specialised by export, or ``dynamic=False``, the model is exported
   again at ``s1`` instead.
4. Saved activations (``_capture_saved``): measured by a forward pass on meta
   under saved-tensor hooks, at ``s1`` and at ``s2``, with dropout and SDPA
   routed to the kernels a GPU runs (bool dropout masks; flash attention saves
   no scores), storages deduplicated, parameters excluded. Models that cannot
   run on meta are measured on their own device instead (logged). Measured, as 4b, on the
   module exported: the three-block proxy stands for a deep uniform stack here too.
4b. The backward's working set (``_capture_grad``): one forward and backward on meta at ``s2``, live
   storages counted per layer's backward window; per class the largest member's (not in ``class_id``:
   structurally identical layers differ in it only by a few bytes at the stack's ends).
5. Per-token coefficients by a two-point fit. For a quantity ``Q`` measured at
   both points, with ``q_i = Q(b, s_i) / (b·s_i)``:

       slope     = (q2 − q1) / (s2 − s1),   intercept = q1 − slope·s1
       Q(b, s)  ≈ b·s·(intercept + slope·s)

   exact for the ``a·bs + c·bs²`` shapes of a transformer. A negative slope
   (a per-call constant, e.g. a ``[h]``-sized op, shrinking per token) is
   charged as ``intercept = q2, slope = 0``. Matmul-family FLOPs (incl. SDPA)
   split this way into ``matmul_flops_per_token`` (intercept) and
   ``attention_flops_per_token_seq`` (slope: QKᵀ and ·V); the slope is checked
   against the op-level count (SDPA + activation × activation matmuls) and a
   mismatch over 1 % is logged. Saved bytes split into boundary and interior
   (``LayerInfo``); a boundary slope (none in the reference blocks) is folded
   into ``saved_interior_per_token_seq`` because ``LayerInfo`` has one seq term.
   Input/output activation bytes per token are taken at ``s2``.
6. Tensor-parallel refusals (``_capture_tp``): a layer whose split the runtime
   could not build at any tp degree (a fused projection with unequal parts, a
   weight used outside a projection) records why in ``LayerInfo.tp_refusal``,
   for ``Plan.check_compatible`` to refuse a forced plan before any rank starts.
7. ``class_id``: ``"<kind>:<sha256[:10]>"`` of kind, parameters (names relative
   to the layer, shapes, dtypes, roles), tied parameter names, every cost
   coefficient (9 significant digits) and the shape metadata; equal ids mean
   structurally identical layers that the solver may decide once.

Korthikanti check ([Note: saved-activation residual]). For the GPT reference
block with ``attn_impl="math"`` and dropout, the measured per-block bytes equal
``sbh(34 + 5as/h)`` plus (a) the boolean causal mask ``~mask`` that
``masked_fill`` keeps, ``s²`` bytes per block independent of the batch, and (b)
the fp32 mean and reciprocal standard deviation of the two LayerNorms, ``16·bs``
bytes; together +0.24 % at ``h=768, a=12, s=128, b=1`` and +0.6 % at ``s=1024``
(the fit charges (a) per token at the capture batch). The formula omits both.
Without the GPU kernel profile the CPU dropout masks (2 bytes in bf16, not 1)
made the measurement 9 % high at ``s=128``: a measurement error, not a residual.
With ``attn_impl="sdpa"`` the block saves ``sbh·34`` plus the fp32 log-sum-exp:
the flash kernel recomputes the scores, as selective recompute would.

MoE note: the reference MoE layer in dropless mode computes every expert on a
``[E, T, h]`` buffer; capture prices the graph as written (``E/k`` times the
routed FLOPs). ``LayerInfo.num_experts`` and ``top_k`` let the cost model rescale
for a grouped-GEMM runtime.

Both export and measurement run with the model in training mode (dropout
active), the mode of a PPO update.

A model captured before with the same structure, code, inputs and options (by another process
too) is read from the capture cache instead (``_capture_cache``: its key, its folder, and
``AUTOSHARD_EXPORT_CACHE=0`` to turn it off).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from autoshard.errors import CaptureError
from autoshard.graph import LayerInfo, ModelGraph, OpCoverage
from autoshard.models import build
from autoshard.passes import _capture_cache
from autoshard.passes._capture_blocks import recognise_layers
from autoshard.passes._capture_costs import MATMUL_OPS
from autoshard.passes._capture_export import Accum, Exported, GraphView, edges, export, price
from autoshard.passes._capture_inputs import InputSpec, ModelInputs, bind_example
from autoshard.passes._capture_layers import (
    LayerSpec,
    dtype_name,
    find_layers,
    layer_params,
    model_hidden_vocab,
    module_weight_roles,
    param_roles,
    shape_meta,
)
from autoshard.passes._capture_proxy import Proxy, make_proxy
from autoshard.passes._capture_report import format_coverage, format_layer_table
from autoshard.passes._capture_grad import GradWorking, measure_grad_working
from autoshard.passes._capture_saved import SavedBytes, measure_saved
from autoshard.passes._capture_tp import tp_refusals
from autoshard.progress import ProgressFn, Update

log = logging.getLogger(__name__)

DEFAULT_LONG_SEQ = 256  # s2 when neither example inputs nor seq_lens say otherwise (capped by max_seq_len)
_META_FIELDS = ("num_heads", "num_kv_heads", "num_experts", "top_k", "hidden", "ffn_hidden", "vocab")
_MAX_SEQ_ATTRS = ("max_seq_len", "max_position_embeddings", "block_size", "n_positions", "max_seq")


def capture(
    model: nn.Module,
    example_inputs: tuple | dict | None = None,
    *,
    name: str | None = None,
    seq_lens: tuple[int, int] | None = None,
    batch: int = 2,
    dynamic: bool = True,
    export_all_blocks: bool = False,
    progress: ProgressFn | None = None,
) -> ModelGraph:
    """Capture ``model`` into a ``ModelGraph`` (steps and formulas in the module docstring).

    Args:
        model: the policy; its first forward input is tokens ``[B, S]``. Any
            device, meta included; parameter values are not read (except by
            the real-device fallback of the saved-activation measurement).
        example_inputs: forward arguments, a tuple or a dict of keywords
            (``_capture_inputs``, [Note: model inputs]). Default: zero tokens ``[batch, s2]``
            on the model's device. When given, ``S`` of the first input is
            ``s2`` unless ``seq_lens`` says otherwise, and every dim ≥ 1 of
            every tensor input whose size is ``S`` is resized to the measured
            sequence length (narrowed, or zero-filled when longer).
        name: model name recorded in the graph (default: the class name).
        seq_lens: the two sequence lengths ``(s1, s2)``, ``2 ≤ s1 < s2``, of the
            two-point fit. Default: ``(S//2, S)`` for example inputs, else
            ``s2 = min(256, model.config.max_seq_len)`` and ``s1 = s2 // 2``.
        batch: batch size of the default inputs (ignored with example inputs).
        dynamic: export with dynamic batch and sequence dims (``Dim.AUTO``);
            ``False`` exports twice with static shapes.
        export_all_blocks: export every block even when the stack qualifies
            for the three-block proxy (``_capture_proxy``; same result, slower).
        progress: receives ``Update("capture NAME", k, 3, unit="steps")`` as export,
            the saved-activation measurement and the per-layer costs start and end
            (``autoshard/progress.py``); ``None``: silent.

    Raises:
        CaptureError: the model cannot be exported (the message names the
            module and op), or the arguments are invalid.
    """
    model_name = name or type(model).__name__
    step = _steps_reporter(progress, f"capture {model_name}")
    key = _capture_cache.capture_key(model, example_inputs, (model_name, seq_lens, batch, dynamic, export_all_blocks))
    cached = _capture_cache.load(key)
    if cached is None:
        with _capture_cache.locked(key):  # ranks capturing this model now wait for one (note "one process traces")
            cached = _capture_cache.load(key)
            if cached is None:
                graph = _capture(model, example_inputs, model_name, seq_lens, batch, dynamic, export_all_blocks, step)
                _capture_cache.store(key, graph)
                return graph
    step(3, f"{len(cached.layers)} layers (cached)")
    return cached


def _capture(model: nn.Module, example_inputs: tuple | dict | None, model_name: str, seq_lens: tuple[int, int] | None,
             batch: int, dynamic: bool, export_all_blocks: bool, step: Callable[[int, str], None]) -> ModelGraph:
    """``capture`` without its cache (``_capture_cache``)."""
    layers = find_layers(model)
    hidden, vocab = model_hidden_vocab(model, layers)
    example = _Example.make(model, example_inputs, seq_lens, batch)
    step(0, f"torch.export of {len(layers)} layers")
    with _training_mode(model):
        view, program = _graph_view(model, example, layers, dynamic, model_name, export_all_blocks)
        recognised = recognise_layers(layers, program.exported, program.rename, hidden, example.batch)
        layers = recognised.layers
        roles = param_roles(model, layers, vocab, recognised.roles)
        step(1, "saved activations")
        # on the exported module: the proxy's three blocks stand for all (``_capture_proxy``)
        runs = program.measured(layers)
        saved = [program.spread(_measure_saved(program.module, runs, roles, example.inputs(s), model_name), layers)
                 for s in example.seq_lens]
        working = [program.spread(_measure_grad_working(program.module, runs, example.inputs(s), model_name), layers)
                   for s in example.seq_lens]
    step(2, "layer costs")
    ordered = _execution_order(layers, view.layer_order)
    params = layer_params(ordered, roles)
    refusals = _tp_refusals(program, ordered, params, roles)
    infos = []
    for index, spec in enumerate(ordered):
        meta = {**shape_meta(spec, model, hidden, vocab), **recognised.meta.get(spec.name, {})}
        if spec.name in refusals:
            meta["tp_refusal"] = refusals[spec.name]
        points = [point.get(spec.name, Accum()) for point in view.costs]
        info = _layer_info(spec, index, params[spec.name], points, [s[spec.name] for s in saved], example, meta)
        infos.append(replace(info, class_id=_class_id(info)))
    infos = _with_grad_working(infos, working, [example.batch * s for s in example.seq_lens])
    step(3, f"{len(infos)} layers captured")
    rank = {spec.name: i for i, spec in enumerate(ordered)}
    return ModelGraph(
        model_name=model_name,
        layers=tuple(infos),
        edges=tuple(sorted(view.edges, key=lambda edge: (rank[edge[0]], rank[edge[1]]))),
        dtype=_model_dtype(model),
        hidden=hidden,
        num_blocks=len({spec.block for spec in layers if spec.block is not None}),
        vocab=vocab,
        coverage=_coverage(view.costs[-1].values()),
        capture_seq_lens=example.seq_lens,
        dynamic_dims=view.dynamic_dims,
    )


def _steps_reporter(progress: ProgressFn | None, task: str) -> Callable[[int, str], None]:
    """``step(completed, note)``: one of capture's three steps to ``progress`` (nothing when ``None``)."""

    def step(completed: int, note: str) -> None:
        if progress is not None:
            progress(Update(task, completed, 3, unit="steps", note=note, eta=False))  # export dominates: no ETA

    return step


def capture_reference(
    spec: str, *, seq_lens: tuple[int, int] | None = None, batch: int = 2, progress: ProgressFn | None = None,
    **overrides: object
) -> ModelGraph:
    """Build reference model ``spec`` (``"llama:70b"``) on meta in bf16 and capture it (``progress``: as ``capture``).

    ``overrides`` go to ``autoshard.models.build`` (config fields such as
    ``dropout=0.1, attn_impl="math"``; ``device`` and ``dtype`` default to
    ``"meta"`` and ``torch.bfloat16``: 16-bit saved activations, as Korthikanti
    et al. assume). Raises ``ModelError`` (a ``CaptureError``) for an unknown spec.
    """
    device = overrides.pop("device", "meta")
    dtype = overrides.pop("dtype", torch.bfloat16)
    model = build(spec, device=device, dtype=dtype, **overrides)
    return capture(model, name=spec, seq_lens=seq_lens, batch=batch, progress=progress)


# ---------------------------------------------------------------------------------------------
# example inputs


@dataclass(frozen=True)
class _Example:
    """Forward inputs at the reference sequence length and how to resize them."""

    base: tuple
    batch: int
    base_seq: int
    seq_lens: tuple[int, int]

    @staticmethod
    def make(model: nn.Module, example_inputs: tuple | dict | None, seq_lens: tuple[int, int] | None,
             batch: int) -> _Example:
        if example_inputs is None:
            if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
                raise CaptureError(
                    f"batch={batch!r}: must be a positive integer (2 or more keeps the batch dim dynamic)"
                )
            s1, s2 = seq_lens or _default_seq_lens(model)
            tokens = torch.zeros(batch, s2, dtype=torch.long, device=_model_device(model))
            return _Example((tokens,), batch, s2, _check_seq_lens((s1, s2)))
        example_inputs, _ = bind_example(model, example_inputs)  # positional; contract: [Note: model inputs]
        if _model_device(model).type == "meta":  # a model on meta is planned from shapes: its inputs follow it
            example_inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
        tokens = example_inputs[0]
        seq = tokens.shape[1]
        lens = seq_lens or (seq // 2, seq)
        log.info("capture: sequence lengths %s (%s)", lens, "given" if seq_lens else "S//2 and S of the example")
        return _Example(example_inputs, tokens.shape[0], seq, _check_seq_lens(lens))

    def inputs(self, seq: int) -> tuple:
        """The example inputs with every sequence-sized dim (≥ 1) resized to ``seq``."""
        return tuple(_resize_seq(x, self.base_seq, seq) for x in self.base)


def _resize_seq(x: object, old: int, new: int) -> object:
    if not isinstance(x, torch.Tensor) or old == new:
        return x
    shape = [new if (d >= 1 and size == old) else size for d, size in enumerate(x.shape)]
    if new <= old:
        for d, size in enumerate(shape):
            x = x.narrow(d, 0, size)
        return x
    return torch.zeros(shape, dtype=x.dtype, device=x.device)


def _check_seq_lens(lens: tuple[int, int]) -> tuple[int, int]:
    ok = (
        isinstance(lens, (tuple, list)) and len(lens) == 2
        and all(isinstance(s, int) and not isinstance(s, bool) for s in lens) and 2 <= lens[0] < lens[1]
    )
    if not ok:
        raise CaptureError(
            f"seq_lens={lens!r}: need two integers 2 <= s1 < s2 for the two-point fit; "
            "pass e.g. seq_lens=(64, 128), or example tokens with S >= 4"
        )
    return int(lens[0]), int(lens[1])


def _default_seq_lens(model: nn.Module) -> tuple[int, int]:
    config = getattr(model, "config", None)
    limits = [getattr(config, a) for a in _MAX_SEQ_ATTRS if isinstance(getattr(config, a, None), int)]
    s2 = min([DEFAULT_LONG_SEQ, *limits])
    log.info("capture: sequence lengths (%d, %d) (s2 = min(%d, max sequence))", s2 // 2, s2, DEFAULT_LONG_SEQ)
    return s2 // 2, s2


def _model_device(model: nn.Module) -> torch.device:
    for t in [*model.parameters(), *model.buffers()]:
        return t.device
    return torch.device("cpu")


def _model_dtype(model: nn.Module) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return dtype_name(p.dtype)
    return dtype_name(torch.get_default_dtype())


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[None]:
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


# ---------------------------------------------------------------------------------------------
# export and measurement


@dataclass(frozen=True)
class _Program:
    """The exported program capture read (the proxy's when it was used) and how to name into it."""

    exported: Exported
    module: nn.Module  # the module exported: the model, or the proxy sharing its blocks
    rename: Callable[[str], str]  # full-model module / parameter name → its name in ``module``
    proxy: Proxy | None = None

    def measured(self, layers: list[LayerSpec]) -> list[LayerSpec]:
        """The layers ``module`` runs, under their full-model names: on the proxy, all but the middle blocks'."""
        return layers if self.proxy is None else [s for s in layers if self.proxy.stand_in(s.name) == s.name]

    def spread(self, measured: dict[str, Any], layers: list[LayerSpec]) -> dict[str, Any]:
        """A measurement of ``self.measured(layers)`` for every layer: on the proxy, a middle block's layers take
        block 1's (``Proxy.stand_in``)."""
        if self.proxy is None or not measured:
            return measured
        return {s.name: measured[self.proxy.stand_in(s.name)] for s in layers if self.proxy.stand_in(s.name) in measured}


def _graph_view(
    model: nn.Module,
    example: _Example,
    layers: list[LayerSpec],
    dynamic: bool,
    model_name: str,
    export_all_blocks: bool,
) -> tuple[GraphView, _Program]:
    """Export (a three-block proxy when it qualifies, else the whole model) and price every layer."""
    names = [spec.name for spec in layers]
    proxy = None if export_all_blocks else make_proxy(model)
    if proxy is not None:
        proxy_names = list(dict.fromkeys(proxy.proxy_name(n) for n in names))
        try:
            view, exported = _export_view(proxy.module, example, proxy_names, dynamic, model_name)
        except CaptureError as exc:
            log.info("capture: proxy export of %s failed (%s); exporting every block", model_name, exc)
        else:
            full = proxy.expand(view, exported)
            if full is not None:
                log.info("capture: %s: exported blocks 0, 1, %d of %d identical blocks", model_name,
                         proxy.num_blocks - 1, proxy.num_blocks)
                return full, _Program(exported, proxy.module, proxy.proxy_name, proxy)
            log.info("capture: %s: proxy graph failed the replication checks; exporting every block", model_name)
    view, exported = _export_view(model, example, names, dynamic, model_name)
    return view, _Program(exported, model, lambda name: name)


def _export_view(
    model: nn.Module, example: _Example, names: list[str], dynamic: bool, model_name: str
) -> tuple[GraphView, Exported]:
    """Export at ``s2`` (and at ``s1`` if the seq dim is static), price at both points (module docstring, step 3)."""
    s1, s2 = example.seq_lens
    primary = export(model, example.inputs(s2), dynamic, names, model_name)
    if dynamic and primary.seq_symbol is not None:
        points = [(primary, primary.size_at(s1)), (primary, primary.size_at(s2))]
    else:
        if dynamic:
            log.info("capture: export specialised the sequence dim of %s; exporting again at s1=%d", model_name, s1)
        first = export(model, example.inputs(s1), dynamic, names, model_name)
        points = [(first, first.size_at(None)), (primary, primary.size_at(None))]
    costs = tuple(price(graph, size) for graph, size in points)
    return GraphView(primary.layer_order, edges(primary), costs, primary.dynamic_dims), primary


def _coverage(accums) -> OpCoverage:
    counted: Counter = Counter()
    unaccounted: Counter = Counter()
    for acc in accums:
        counted.update(acc.counted)
        unaccounted.update(acc.unaccounted)
    return OpCoverage(counted=dict(sorted(counted.items())), unaccounted=dict(sorted(unaccounted.items())))


def _measure_saved(
    model: nn.Module, layers: list[LayerSpec], roles: dict[int, str], inputs: tuple, model_name: str
) -> dict[str, SavedBytes]:
    weight_roles = module_weight_roles(layers, roles)
    try:
        return measure_saved(model, layers, weight_roles, inputs, on_meta=True)
    except Exception as exc:  # a model that runs for real may still not run on meta
        if _model_device(model).type == "meta":
            raise CaptureError(
                f"cannot measure saved activations of {model_name} on meta: {type(exc).__name__}: {exc}; "
                "make the forward device-agnostic (create tensors on the input's device)"
            ) from exc
        log.warning("capture: meta forward of %s failed (%s); measuring on %s", model_name, exc, _model_device(model))
        return measure_saved(model, layers, weight_roles, inputs, on_meta=False)


def _measure_grad_working(model: nn.Module, layers: list[LayerSpec], inputs: tuple,
                          model_name: str) -> dict[str, GradWorking]:
    """``_capture_grad``'s measurement, or none (logged) for a model whose backward cannot run on meta."""
    try:
        return measure_grad_working(model, layers, inputs)
    except Exception as exc:  # the cost model then prices no backward working set, as before it was measured
        log.warning("capture: meta backward of %s failed (%s: %s); backward working set not priced",
                    model_name, type(exc).__name__, exc)
        return {}


def _with_grad_working(infos: list[LayerInfo], working: list[dict[str, GradWorking]],
                       tokens: list[int]) -> list[LayerInfo]:
    """Each layer with its class's backward working set (step 4b): ``W`` fitted through the two points as
    ``per_token·T + fixed`` (a weight-shaped copy does not grow with T; a negative part is dropped, as
    ``_fit`` does), ``f`` and ``end`` at ``s2``; per class the largest of the members'."""
    (t1, t2), (first, second) = tokens, working
    fitted: dict[str, tuple[float, float, float, float]] = {}
    for info in infos:
        w1, w2 = first.get(info.name, GradWorking()), second.get(info.name, GradWorking())
        slope = (w2.peak - w1.peak) / (t2 - t1)
        fixed = w2.peak - slope * t2
        if slope < 0 or fixed < 0:
            slope, fixed = w2.peak / t2, 0.0
        fitted[info.name] = (slope, fixed, w2.param_fraction, w2.end / t2)
    by_class: dict[str, list[tuple[float, float, float, float]]] = {}
    for info in infos:
        by_class.setdefault(info.class_id, []).append(fitted[info.name])
    out = []
    for info in infos:
        members = by_class[info.class_id]
        out.append(replace(info, grad_working_per_token=max(m[0] for m in members),
                           grad_working_fixed_bytes=max(m[1] for m in members),
                           grad_working_param_fraction=max(members, key=lambda m: m[0] * t2 + m[1])[2],
                           grad_working_end_per_token=max(m[3] for m in members)))
    return out


def _tp_refusals(program: _Program, ordered: list[LayerSpec], params: dict, roles: dict[int, str]) -> dict[str, str]:
    """Layer name → why tp cannot split it (``_capture_tp``), named with the full model's parameter names."""
    found = tp_refusals(program.exported, lambda fqn: roles.get(id(program.module.get_parameter(fqn)), "replicate"))
    out = {}
    for spec in ordered:
        for param in params[spec.name][0]:
            exported_name = program.rename(param.name)
            if exported_name in found:
                out[spec.name] = found[exported_name].replace(repr(exported_name), repr(param.name))
                break
    return out


def _execution_order(layers: list[LayerSpec], layer_order: tuple[str, ...]) -> list[LayerSpec]:
    """Layers by their first graph node; layers without nodes (never called) last, in registration order."""
    by_name = {spec.name: spec for spec in layers}
    ran = [by_name[name] for name in layer_order]
    return ran + [spec for spec in layers if spec.name not in layer_order]


# ---------------------------------------------------------------------------------------------
# per-token coefficients and assembly


def _fit(values: tuple[float, float], batch: int, seq_lens: tuple[int, int]) -> tuple[float, float]:
    """(intercept, slope) of Q/(b·s) = intercept + slope·s through the two points (module docstring, step 5)."""
    (s1, s2), (v1, v2) = seq_lens, values
    q1, q2 = v1 / (batch * s1), v2 / (batch * s2)
    slope = (q2 - q1) / (s2 - s1)
    if slope < 0:
        return q2, 0.0
    return q1 - slope * s1, slope


def _ep_refusal(kind: str, point: Accum) -> str:
    """Why the expert-parallel pass cannot run on a ``moe`` layer ("" when it can): it exchanges fixed
    ``[E, C, h]`` capacity buffers around ``bmm`` expert matmuls (``passes/_expert_parallel.py``), so
    experts computed another way (``_grouped_mm`` over token-sorted rows with data-dependent group sizes,
    as Hugging Face's Mixtral does, or a loop of per-expert ``linear``) have no point to dispatch at."""
    if kind != "moe" or "aten.bmm" in point.counted:
        return ""
    ops = sorted(op for op in point.counted if op in MATMUL_OPS)
    return (f"its matmuls are {', '.join(ops) or 'none'}: no bmm on a per-expert capacity buffer [E, C, h], "
            "which is what the expert-parallel all-to-all exchanges")


def _layer_info(
    spec: LayerSpec,
    index: int,
    params: tuple,
    points: list[Accum],
    saved: list[SavedBytes],
    example: _Example,
    meta: dict,
) -> LayerInfo:
    b, lens = example.batch, example.seq_lens

    def fit(values) -> tuple[float, float]:
        return _fit(tuple(values), b, lens)

    matmul, attention = fit(p.matmul_flops for p in points)
    _check_attention_split(spec.name, points[-1], attention, b, lens[-1])
    elementwise, elementwise_seq = fit(p.elementwise_flops for p in points)
    moved, moved_seq = fit(p.bytes for p in points)
    boundary, boundary_seq = fit(s.boundary for s in saved)
    interior, interior_seq = fit(s.interior for s in saved)
    tokens = b * lens[-1]
    owned, tied = params
    meta = {**meta, "ep_refusal": _ep_refusal(spec.kind, points[-1])} if spec.kind == "moe" else meta
    return LayerInfo(
        name=spec.name,
        kind=spec.kind,
        index=index,
        block=spec.block,
        class_id="",
        params=owned,
        tied_params=tied,
        matmul_flops_per_token=matmul,
        attention_flops_per_token_seq=attention,
        elementwise_flops_per_token=elementwise,
        elementwise_flops_per_token_seq=elementwise_seq,
        bytes_per_token=moved,
        bytes_per_token_seq=moved_seq,
        saved_boundary_per_token=boundary,
        saved_interior_per_token=interior,
        saved_interior_per_token_seq=interior_seq + boundary_seq,
        input_bytes_per_token=points[-1].input_bytes / tokens,
        output_bytes_per_token=points[-1].output_bytes / tokens,
        **meta,
    )


def _check_attention_split(layer: str, at_s2: Accum, slope: float, batch: int, seq: int) -> None:
    """Cross-check: the fitted attention FLOPs against the op-level count (SDPA, activation matmuls)."""
    fitted = slope * batch * seq * seq
    measured = at_s2.attention_op_flops
    if abs(fitted - measured) > 0.01 * max(fitted, measured, 1.0):
        log.warning(
            "capture: %s: attention FLOPs from the two-point fit (%.4g) and from SDPA/activation matmuls "
            "(%.4g) differ by more than 1%%", layer, fitted, measured,
        )


def _class_id(info: LayerInfo) -> str:
    """``"<kind>:<hash>"`` of the layer's structure and costs (module docstring, step 6)."""
    prefix = len(info.name) + 1
    numbers = {
        f.name: float(f"{getattr(info, f.name):.9g}")
        for f in fields(LayerInfo)
        if isinstance(getattr(info, f.name), float) and not f.name.startswith("grad_working")
    }
    blob = {
        "kind": info.kind,
        "params": [(p.name[prefix:], list(p.global_shape), p.dtype, p.tp_role) for p in info.params],
        "tied": [name[prefix:] for name in info.tied_params],
        "costs": numbers,
        "meta": [getattr(info, f) for f in _META_FIELDS],
        **({"batch_free_output": True} if info.batch_free_output else {}),  # absent otherwise: ids stay as they were
    }
    digest = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:10]
    return f"{info.kind}:{digest}"


__all__ = ["InputSpec", "ModelInputs", "bind_example", "capture", "capture_reference", "format_coverage",
           "format_layer_table"]
