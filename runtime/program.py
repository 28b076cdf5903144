"""Per-rank program: export → passes → a module that trains its shards.

``build_program(model, graph, plan, train, options=BuildOptions(), ctx=None)``:

1. checks, before any collective: the plan matches the model
   (``plan.check_compatible(graph=...)``), the live world size equals the
   mesh's, every pipeline stage has a layer, and the plan asks only for what
   the runtime implements (cp = 1; ``PlanError`` otherwise);
2. builds the device mesh and ``RankContext`` (``runtime/mesh.py``);
3. exports a *copy* of the model (``ep.module()`` shares Parameter objects
   with its input) with dynamic batch and sequence dims;
4. runs ``autoshard.passes.PASSES`` (shard_parameters, insert_collectives,
   recompute, schedule_overlap, quantize_comm, split_pipeline); with pp > 1
   the result is a ``PipelineSplit`` holding only this rank's stages;
5. builds the ``ShardedOptimizer`` from fp32 master shards cut from the
   original fp32 parameters (the compute copies are ``train.precision``),
   over this rank's parameters only (with pp > 1: its stages' parameters),
   with ``train``'s optimizer, learning-rate schedule and clipping
   (``OptimizerConfig.from_train``) unless ``optimizer=`` overrides them.

``Program.step(tokens, loss_fn)``: ``tokens`` is this rank's data-parallel
slice ``[B_local, S]`` (``Program.local_batch`` cuts it from a global batch);
it is split into ``plan.schedule.num_micro_batches`` micro-batches along dim 0;
each micro-batch's ``loss_fn(outputs, micro_tokens)`` (a mean over the
micro-batch) is divided by the number of micro-batches and backpropagated; the
optimizer then averages gradients over dp (the mean of per-rank losses equals
the single-device loss on the global batch when slices are equal), clips and
updates. Eager, the graph runs inside the ZeRO-3 re-gather hooks when present
(``passes/recompute.py``); compiled, the re-gathers are nodes of the backward graph.

Models with more inputs than the tokens ([Note: model inputs] in
``passes/_capture_inputs.py``: a padding mask, position ids, segment ids of
packed rows): the program takes exactly the tensors of ``compile``'s
``example_inputs`` — ``forward`` is called as the model is (``program(ids,
attention_mask=mask)``), and ``step``/``local_batch`` take a dict: the inputs by
forward's parameter names plus any entry ``loss_fn`` needs (labels, a loss
mask). Every ``[B, ...]`` entry is cut by the same rows (dp slice, then
micro-batch); an input the model broadcasts (``[1, ...]``) goes whole;
``loss_fn(outputs, micro)`` gets the micro-batch dict. With padding, a mean per
micro-batch weighs tokens unequally; ``step(..., normalize_by="loss_mask")``
instead takes ``loss_fn``'s sum and divides it by the global sum of that entry:
the token mean over the global batch, independent of dp and micro-batching.

Pipeline parallelism (pp > 1, ``runtime/pipeline.py``): ``step`` runs the
plan's schedule (GPipe / 1F1B / interleaved 1F1B) over the same
micro-batches; the last stage computes ``loss_fn`` and the mean micro-batch
loss is all-reduced over pp, so every rank returns the same ``StepResult``.
Clipping needs no pp-specific term: stages hold disjoint parameters and the
optimizer's norm all-reduce spans the world. ``forward(tokens)`` runs the
stages in order without autograd and returns the full outputs on every rank.
Every stage gets every model input by keyword; with a dict batch the
schedule's target is the row indices, from which ``loss_fn``'s micro-batch is
cut. An input broadcast over the batch cannot be split by the schedule:
``PlanError`` at build.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch import nn

from autoshard.errors import AutoshardError, PlanError
from autoshard.graph import ModelGraph
from autoshard.passes import run_passes
from autoshard.passes._capture_export import registering_output_dataclasses
from autoshard.passes._capture_inputs import InputSpec, ModelInputs
from autoshard.passes._graph_utils import META_KEY, retarget_device
from autoshard.passes.context import ParamPlacement, PassState, RankContext, pass_state
from autoshard.passes.schedule_overlap import compile_options
from autoshard.passes.split_pipeline import PipelineSplit
from autoshard.plan import Plan
from autoshard.kernels import collectives
from autoshard.runtime.build_options import BuildOptions, Compile, Overlap, Regions
from autoshard.runtime.compile_regions import insert_region_breaks
from autoshard.runtime.compiled_loss import LossCompiler, compiles_loss
from autoshard.runtime.export_cache import cached_export
from autoshard.runtime.inductor_fallback import overlap_on, overlap_safe_backend
from autoshard.runtime.pipeline import PipelineEngine
from autoshard.runtime.materialize import Wanted, bind_source, fill, meta_twin
from autoshard.runtime.memory_report import BuildMemory, MemoryReport
from autoshard.runtime.mesh import build_device_mesh, build_rank_context, check_world
from autoshard.runtime.optimizer import OptimizerConfig, ShardedOptimizer
from autoshard.train import TrainSpec

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# what ``Program.step`` and ``local_batch`` take: tokens [B, S], or a dict of the model's inputs and loss entries
Batch = Union[torch.Tensor, Mapping[str, Any]]


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: loss averaged over micro-batches and dp ranks, global gradient norm (before
    clipping), and the learning rate the update used (``TrainSpec.lr_schedule``)."""

    loss: float
    grad_norm: float
    lr: float = 0.0


class Program:
    """This rank's executable: the rewritten graph, its parameter placements and the sharded optimizer."""

    def __init__(self, gm: torch.fx.GraphModule | PipelineSplit, plan: Plan, ctx: RankContext, optimizer: ShardedOptimizer,
                 *, options: BuildOptions = BuildOptions(), inputs: ModelInputs | None = None):
        self.gm, self.plan, self.ctx, self.optimizer = gm, plan, ctx, optimizer
        # the model's tensor inputs, in the graph's order ([Note: model inputs], passes/_capture_inputs.py)
        self.inputs = inputs or _tokens_input(gm)
        self.build_memory = BuildMemory(torch.device(ctx.device))  # build_program replaces it with the measured one
        state = pass_state(gm)
        self.param_placements: dict[str, ParamPlacement] = state.placements
        name = state.regather
        self.regather = gm.get_submodule(name) if name else None
        self.pipeline = PipelineEngine(gm, ctx, plan.schedule, self.regather) if isinstance(gm, PipelineSplit) else None
        if self.pipeline is None and options.overlap_grad_sync:
            optimizer.enable_overlap()  # DP gradient buckets reduce under the last micro-batch's backward
        self._run = self.gm
        self.compile_options: dict | None = None  # what the compiled program was compiled with (None: eager)
        # compiled by inductor on CUDA: Program.step compiles the caller's loss too (runtime/compiled_loss.py)
        self.loss_compiler = LossCompiler(compiles_loss(ctx.compiled, ctx.device, options.backend))
        if ctx.compiled:
            # pp > 1: each local stage compiles on its own (runtime/pipeline.py)
            modules = [gm.stage(k) for k in gm.layout.local_stages] if self.pipeline is not None else [self.gm]
            if options.regions is not Regions.GRAPH:  # runtime/compile_regions.py
                for module in modules:
                    insert_region_breaks(module, options.regions.value)
            self.compile_options = state.compile_options or compile_options(plan, ctx.device)
            if options.overlap is not Overlap.PLAN:
                self.compile_options = compile_options(plan, ctx.device, options.overlap.value)
            inductor = _known_inductor_options(self.compile_options["inductor"]) if options.backend == "inductor" else None
            backend: str | Callable = options.backend
            if inductor and overlap_on(inductor):  # runtime/inductor_fallback.py: a graph the passes fail on
                self.compile_options["fallbacks"] = []  # compiles without them, recorded here
                backend = overlap_safe_backend(inductor, self.compile_options["fallbacks"])
                inductor = None
            # one compiled graph per region and input shape (training shapes are fixed); the ZeRO-3 gathers
            # are functional collectives inductor schedules, the other autoshard:: collectives opaque calls
            def compile_fn(module: nn.Module) -> Callable:
                return torch.compile(module, dynamic=False, backend=backend, options=inductor or None)

            if self.pipeline is not None:
                self.pipeline.compile(compile_fn)
            else:
                self._run = compile_fn(self.gm)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the per-rank graph on the model's inputs, called as the model is: ``program(tokens)``,
        ``program(tokens, attention_mask=mask)``, ... (outputs as the model returns them).

        The inputs are the captured ones (``compile(example_inputs=...)``; [Note: model inputs] in
        ``passes/_capture_inputs.py``): a missing one, one the example did not have, or one whose
        batch, sequence, other dims or dtype differ from the tokens' raises ``AutoshardError`` naming it.
        With pp > 1: no autograd; every rank gets the full outputs (module docstring).
        """
        inputs = self.inputs.bind(args, kwargs)
        if self.pipeline is not None:
            return self.pipeline.forward(self._stage_inputs(inputs))
        flat = [t.to(self.ctx.device) for t in inputs.values()]
        if self.regather is None:
            return self._run(*flat)
        with self.regather.hooks():
            return self.gm(*flat)

    __call__ = forward

    def local_batch(self, global_batch: Batch) -> Batch:
        """This rank's dp slice of a global batch: tokens ``[B, S]``, or a dict of them and the other inputs
        (``_split_batch``: every ``[B, ...]`` tensor cut the same way, by the combined dp coordinate)."""
        dp = self.ctx.size("dp")
        rows = self._rows(global_batch)
        if rows % dp:
            raise PlanError(f"global batch {rows} is not divisible by dp={dp}; use a multiple of {dp}")
        return self._split_batch(global_batch, dp)[self.ctx.coord("dp")]

    def step(self, batch: Batch, loss_fn: Callable[[Any, Batch], torch.Tensor], *,
             normalize_by: str | None = None) -> StepResult:
        """Forward/backward over micro-batches of ``batch``, then one optimizer step (module docstring).

        ``batch``: this rank's tokens ``[B_local, S]``, or a dict holding the model's inputs by name
        (the tokens under forward's first parameter's name) and anything else ``loss_fn`` needs
        (labels, a loss mask): each micro-batch is the same rows of every ``[B, ...]`` tensor, and
        ``loss_fn(outputs, micro)`` gets it in the form ``batch`` came in.

        ``normalize_by``: ``None`` — ``loss_fn`` returns the micro-batch's mean and the step's loss is
        the mean over micro-batches and dp ranks. A key of ``batch`` (e.g. ``"loss_mask"``) —
        ``loss_fn`` returns the micro-batch's *sum* and the step's loss is the sum over the global
        batch divided by the global sum of ``batch[normalize_by]`` (one all-reduce over dp first):
        the token mean of the global batch, whatever the padding, dp size and micro-batching.

        A program compiled by inductor on CUDA runs ``loss_fn`` compiled (runtime/compiled_loss.py).
        """
        m = self.plan.schedule.num_micro_batches
        rows = self._rows(batch)
        if rows % m:
            raise PlanError(
                f"local batch {rows} is not divisible by num_micro_batches={m}; pass a multiple of {m} rows per rank"
            )
        weight = self._loss_weight(batch, normalize_by)
        loss_fn = self.loss_compiler(loss_fn)
        if self.pipeline is not None:
            total = self._pipeline_step(batch, loss_fn, None if weight is None else weight * m)
        else:
            total = self._accumulate(batch, loss_fn, weight)
        if self.ctx.size("dp") > 1:
            total = collectives.all_reduce(total.reshape(1), self.ctx.group("dp"), "avg")[0]
        norm = self.optimizer.step()
        return StepResult(loss=float(total), grad_norm=norm, lr=self.optimizer.last_lr)

    def _accumulate(self, batch: Batch, loss_fn: Callable, weight: float | None) -> torch.Tensor:
        """Forward/backward of every micro-batch on one stage; the mean micro-batch loss, or with ``weight``
        (``normalize_by``) Σ weight·loss_fn ([] fp32)."""
        m = self.plan.schedule.num_micro_batches
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for i, micro in enumerate(self._split_batch(batch, m)):
            micro = _to_device(micro, self.ctx.device)
            loss = loss_fn(self.forward(**self._model_inputs(micro)), micro)
            loss = loss / m if weight is None else loss * weight
            if i == m - 1:
                self.optimizer.arm()  # overlapped gradient sync: this backward completes every gradient
            loss.backward()
            if self.regather is not None:
                self.regather.reset()
            total += loss.detach().float()
        return total

    def _pipeline_step(self, batch: Batch, loss_fn: Callable, scale: float | None) -> torch.Tensor:
        """``PipelineEngine.train_step`` (which divides each micro-batch loss by m) with ``loss_fn`` times ``scale``.

        The schedule splits one ``target`` tensor into micro-batches; for a dict batch it is the row
        indices, and ``loss_fn`` gets those rows of every entry."""
        inputs = self._stage_inputs(self.inputs.check(self._model_inputs(batch)))
        if scale is not None:
            loss_fn = functools.partial(_scaled, loss_fn, scale)
        if isinstance(batch, torch.Tensor):
            return self.pipeline.train_step(inputs, batch, loss_fn)
        whole = _to_device(batch, self.ctx.device)
        rows = torch.arange(self._rows(batch), device=self.ctx.device)

        def rows_loss(out: Any, index: torch.Tensor) -> torch.Tensor:
            micro = {k: v.index_select(0, index) if _is_rows(v, len(rows)) else v for k, v in whole.items()}
            return loss_fn(out, micro)

        return self.pipeline.train_step(inputs, rows, rows_loss)

    def _loss_weight(self, batch: Batch, normalize_by: str | None) -> float | None:
        """What each micro-batch's ``loss_fn`` is multiplied by before backward with ``normalize_by`` (else
        ``None``: divided by m). The optimizer averages gradients over dp, hence ``dp / N`` for a global sum N."""
        if normalize_by is None:
            return None
        if not isinstance(batch, Mapping) or normalize_by not in batch:
            keys = sorted(batch) if isinstance(batch, Mapping) else "a tensor batch (no keys)"
            raise AutoshardError(f"normalize_by={normalize_by!r} is not a key of the batch ({keys}); name the "
                                 "batch entry whose sum counts the loss tokens (e.g. a loss mask)")
        count = batch[normalize_by].detach().to(self.ctx.device, torch.float64).sum().reshape(1)
        dp = self.ctx.size("dp")
        if dp > 1:
            count = collectives.all_reduce(count, self.ctx.group("dp"), "sum")
        if float(count) <= 0:
            raise AutoshardError(f"batch[{normalize_by!r}] sums to {float(count)} over the global batch: no token "
                                 "to average the loss over")
        return dp / float(count)

    # ------------------------------------------------------------------ batches ([Note: model inputs])

    def _rows(self, batch: Batch) -> int:
        """Rows of ``batch``'s tokens."""
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0])
        name = self.inputs.tokens.name
        if not isinstance(batch, Mapping) or not isinstance(batch.get(name), torch.Tensor):
            what = f"keys {sorted(batch)}" if isinstance(batch, Mapping) else type(batch).__name__
            raise AutoshardError(f"batch: expected tokens [B, S] or a dict with the tokens under {name!r} "
                                 f"(forward's first parameter); got {what}")
        return int(batch[name].shape[0])

    def _split_batch(self, batch: Batch, parts: int) -> list[Batch]:
        """``batch`` in ``parts`` equal row chunks: every ``[B, ...]`` tensor split along dim 0; an input the
        model broadcasts over the batch, a 0-dim tensor or a non-tensor value goes whole into each part."""
        if isinstance(batch, torch.Tensor):
            return list(batch.chunk(parts, 0))
        rows = self._rows(batch)
        broadcast = {spec.name for spec in self.inputs.tensors if not spec.batched}
        uncaptured = [k for k in batch if k in self.inputs.params and k not in self.inputs.names
                      and batch[k] is not None]
        if uncaptured:
            raise AutoshardError(f"batch[{uncaptured[0]!r}] is an input of forward that was not in example_inputs: "
                                 f"the program takes {', '.join(self.inputs.names)}; capture with it to use it")
        out: list[dict] = [{} for _ in range(parts)]
        for key, value in batch.items():
            if _is_rows(value, rows) and key not in broadcast:
                pieces = value.chunk(parts, 0)
            elif isinstance(value, torch.Tensor) and value.dim() and key not in broadcast:
                raise AutoshardError(f"batch[{key!r}] has {value.shape[0]} rows (dim 0) but the tokens have {rows}: "
                                     f"every batch entry is [B, ...] with the tokens' rows")
            else:
                pieces = [value] * parts
            for part, piece in zip(out, pieces):
                part[key] = piece
        return out

    def _model_inputs(self, batch: Batch) -> dict[str, Any]:
        """The model's inputs of ``batch`` by name (a tensor batch is the tokens)."""
        if isinstance(batch, torch.Tensor):
            return {self.inputs.tokens.name: batch}
        return {k: v for k, v in batch.items()
                if (k in self.inputs.params or k in self.inputs.names) and v is not None}

    def _stage_inputs(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checked inputs by the pipeline stages' placeholder names (same order as ``self.inputs.names``)."""
        return dict(zip(self.pipeline.layout.input_names, inputs.values()))

    def memory_report(self) -> MemoryReport:
        """Measured build peak, resident bytes after the build and (CUDA) step peak (``runtime/memory_report.py``)."""
        return self.build_memory.report()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master values at each ``param_placements[fqn].local_shape`` (collective for ZeRO-1/2/offload)."""
        return {fqn: slot.full_master() for fqn, slot in self.optimizer.slots.items()}

    def load_local_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of ``local_state_dict``: set masters and compute params from local shards."""
        for fqn, slot in self.optimizer.slots.items():
            if tuple(state[fqn].shape) != self.param_placements[fqn].local_shape:
                raise PlanError(
                    f"{fqn}: local shard {tuple(state[fqn].shape)} != placement {self.param_placements[fqn].local_shape}"
                )
            slot.load_master(state[fqn])


def _is_rows(value: Any, rows: int) -> bool:
    """Whether ``value`` is a tensor with ``rows`` rows (dim 0)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def _to_device(batch: Batch, device: Any) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _scaled(loss_fn: Callable, scale: float, outputs: Any, micro: Any) -> torch.Tensor:
    return loss_fn(outputs, micro) * scale


def build_program(
    model: nn.Module,
    graph: ModelGraph,
    plan: Plan,
    train: TrainSpec | None = None,
    *,
    options: BuildOptions = BuildOptions(),
    ctx: RankContext | None = None,
    optimizer: OptimizerConfig | None = None,
    device: str = "cpu",
    weights: Any = None,
    inputs: ModelInputs | None = None,
    exported: torch.fx.GraphModule | None = None,
) -> Program:
    """This rank's ``Program`` for ``plan`` (module docstring: the five steps).

    ``weights``: where this rank's shards come from (``runtime/materialize.py``): ``None`` = the
    model's own parameters when they hold data, else initialised on shards (``Initialize(seed=0)``);
    a path (autoshard checkpoint directory, ``.safetensors`` file, Hugging Face safetensors
    directory); or a source (``Initialize``, ``Safetensors``, ``Checkpoint``, ``FromModule``). The
    model may live on the meta device; no rank ever holds a whole parameter its plan shards.
    ``optimizer``: the runtime's hyper-parameters (``OptimizerConfig``); ``None`` = ``train``'s
    (``OptimizerConfig.from_train``: optimizer, schedule, clipping). ``options``: how the program is
    built and run (``runtime/build_options.py``: compilation, its regions, overlap and backend,
    overlapped gradient sync, memory tracking, releasing the model). Compiled (``Compile.ON``, or
    ``AUTO`` on a CUDA device with a plan of ep = cp = 1; pp > 1: each local stage compiles,
    ``runtime/pipeline.py``), the passes emit the traced forms (``RankContext.compiled``): ZeRO-3
    gathers, their re-gathers in backward and their reduce-scatters are functional-collective nodes
    of the joint graph that inductor schedules (``passes/_zero3.py`` note "compiled gather"; no
    saved-tensor hooks), with the overlap ``schedule_overlap`` chose from the plan unless
    ``options.overlap`` fixes one. On the CPU the graph stays eager by default (the gloo suite's speed).
    Overlapped gradient sync (pp = 1) is off by default: on 4×H100 it made the searched DP plans
    slower (docs/runtime.md, "Overlapped gradient sync").
    ``inputs``: the model's tensor inputs (``autoshard.passes.capture.bind_example`` of the example inputs,
    as ``compile`` passes them; [Note: model inputs]); ``None`` = the tokens alone.
    ``exported``: the model's export for this rank's device and dtype (``export_model``), which the
    passes rewrite in place; ``None`` = export here (``autoshard/check.py`` passes copies of one export
    to build many ranks of a plan in one process).
    """
    precision = train.precision if train is not None else plan.precision
    inputs = inputs or ModelInputs.tokens_only(model)
    _check_plan(plan, graph)
    if plan.mesh.pp > 1:
        inputs.check_pipeline()
    check_world(plan.mesh)
    device_mesh = None
    if ctx is None:
        ctx, device_mesh = build_rank_context(plan.mesh, device=device, compute_dtype=_DTYPES[precision])
    ctx = dataclasses.replace(ctx, compiled=_compiles(options.compile, plan, ctx.device))
    build_memory = BuildMemory(torch.device(ctx.device), options.track_memory)
    with build_memory:
        reader = bind_source(weights, model, release=options.release_model)
        gm = run_passes(exported if exported is not None else _export(model, graph, ctx, inputs), plan, ctx)
        placements = pass_state(gm).placements
        params = gm.local_parameters() if isinstance(gm, PipelineSplit) else dict(gm.named_parameters())
        config = optimizer or (OptimizerConfig.from_train(train) if train is not None
                               else OptimizerConfig(name=plan.optimizer))
        grad_comm = pass_state(gm).grad_comm  # quantize_comm: wire dtype of gradient syncs
        sharded = ShardedOptimizer(params, placements, None, ctx, config, grad_comm,
                                   bucket_bytes=plan.schedule.bucket_bytes,
                                   reduced_in_graph=pass_state(gm).grads_reduced_in_graph)
        if hasattr(reader, "mesh"):  # a DCP checkpoint reads through DTensors over the plan's mesh
            reader.mesh = device_mesh or build_device_mesh(plan.mesh, torch.device(ctx.device).type)
        wanted = [Wanted(fqn, placements[fqn].global_shape, placements[fqn].region(ctx), placements[fqn])
                  for fqn in params]
        expected = {fqn: placement.global_shape for fqn, placement in placements.items()}
        fill(reader, wanted, expected, _program_buffers(gm), torch.device(ctx.device),
             lambda fqn, values: sharded.slots[fqn].load_master(values))
    program = Program(gm, plan, ctx, sharded, options=options, inputs=inputs)
    program.build_memory = build_memory
    return program


def compile_allowed(plan: Plan, device: Any) -> bool:
    """Whether ``Compile.AUTO`` compiles ``plan`` on ``device``: CUDA and ``plan.compilable``
    (ep = cp = 1; ``Compile.ON`` still compiles ep/cp plans)."""
    return torch.device(device).type == "cuda" and plan.compilable


def _compiles(mode: Compile, plan: Plan, device: Any) -> bool:
    """Resolve ``BuildOptions.compile`` for ``plan`` on ``device``."""
    if mode is Compile.AUTO:
        return compile_allowed(plan, device)
    return mode is Compile.ON  # pp > 1: every local stage compiles (runtime/pipeline.py)


def _known_inductor_options(options: dict) -> dict:
    """``options`` without the keys this torch's inductor does not have (older versions lack some passes)."""
    import torch._inductor.config as inductor_config

    # The bucketing passes register their custom ops (``torch.ops.bucketing.*``) when their module is
    # imported, which a compile that runs the passes does; a graph loaded from Inductor's FX cache calls
    # them without running the passes (AttributeError in every warm-cache process, seen on torch 2.11).
    try:
        import torch._inductor.fx_passes.bucketing  # noqa: F401
    except ImportError:  # an inductor without these passes: their options are dropped below
        pass
    _gqa_flop_formulas()
    known = inductor_config.get_config_copy()
    return {k: v for k, v in options.items() if k in known}


def _gqa_flop_formulas() -> None:
    """Let inductor count the FLOPs of grouped-query SDPA (fewer key/value heads than query heads).

    Inductor's compute/communication scheduling estimates a node's runtime from
    ``torch.utils.flop_counter``; before torch 2.13 its SDPA formulas assert equal head counts, so
    compiling any GQA model whose graph holds collectives (Llama-2-70B, Llama-3, Qwen2, Mistral, ...)
    failed with "sdpa_flop_count: query/key/value shapes are incompatible" (measured on torch 2.11,
    H200). Where the installed formula refuses GQA, the SDPA entries of the registry count the
    key/value heads broadcast to the query's, as the kernels compute them; elsewhere nothing changes.
    """
    from torch.utils import flop_counter as fc

    try:
        fc.sdpa_flop_count((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
        return  # this torch counts GQA itself
    except AssertionError:
        pass

    def heads_of(query, *kv):
        return tuple((t[0], query[1], *t[2:]) for t in kv)

    def forward(query, key, value, *_args, out_shape=None, **_kwargs) -> int:
        return fc.sdpa_flop_count(query, *heads_of(query, key, value))

    def backward(grad_out, query, key, value, *_args, out_shape=None, **_kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out, query, *heads_of(query, key, value))

    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
               aten._scaled_dot_product_cudnn_attention):
        fc.flop_registry[op] = fc.shape_wrapper(forward)
    for op in (aten._scaled_dot_product_efficient_attention_backward,
               aten._scaled_dot_product_flash_attention_backward,
               aten._scaled_dot_product_cudnn_attention_backward):
        fc.flop_registry[op] = fc.shape_wrapper(backward)


def _check_plan(plan: Plan, graph: ModelGraph) -> None:
    plan.check_compatible(graph=graph)
    _check_stages(plan)
    # EP is implemented (passes/_expert_parallel.py); context parallelism is not.
    if plan.mesh.cp > 1:
        raise PlanError(
            f"plan uses cp={plan.mesh.cp}: context parallelism is not implemented by the runtime yet; search with cp=1"
        )


def _check_stages(plan: Plan) -> None:
    """Every pipeline stage 0..pp·v-1 must own a layer (an empty stage would only forward activations)."""
    num_stages = plan.mesh.pp * plan.schedule.virtual_stages
    empty = sorted(set(range(num_stages)) - {s.stage for s in plan.layers})
    if empty:
        raise PlanError(
            f"pipeline stages {empty} of {num_stages} (pp={plan.mesh.pp} × virtual_stages="
            f"{plan.schedule.virtual_stages}) own no layer; give every stage at least one layer or lower pp"
        )


def _export(model: nn.Module, graph: ModelGraph, ctx: RankContext, inputs: ModelInputs) -> torch.fx.GraphModule:
    """``torch.export`` of ``model``'s meta twin in the compute dtype (dynamic batch/seq), retargeted to ``ctx.device``.

    The graph's user inputs are ``inputs``' tensors in their order (zeros on meta of 2 rows and a short
    sequence; their batch and sequence dims dynamic); a ``None`` the example skipped is no input.

    No weight is read or copied: the twin has the model's structure with meta tensors
    (``materialize.meta_twin``), so a model on the GPU is not duplicated and one on the meta device
    exports as well. The twin is cast to the compute dtype *before* export: export bakes the dtypes
    it sees into the graph (``_assert_tensor_metadata`` checks, explicit casts such as a norm's
    ``.to(x.dtype)``). It also bakes in the device (factory calls, metadata checks), which
    ``retarget_device`` points at the rank's device.
    """
    gm = _exported_graph(model, ctx.compute_dtype, inputs)
    retarget_device(gm, torch.device("meta"), torch.device(ctx.device))
    owners = {p.name: (layer.name, p.tp_role) for layer in graph.layers for p in layer.params}
    gm.meta[META_KEY] = PassState(params=owners)
    return gm


def _exported_graph(model: nn.Module, compute_dtype: torch.dtype, inputs: ModelInputs) -> torch.fx.GraphModule:
    """The export of ``_export`` before its retargeting, once per model structure per process (``export_cache``)."""
    twin = meta_twin(model).to(compute_dtype)
    seq = min(8, getattr(getattr(model, "config", None), "max_seq_len", 8))
    args, kwargs, shapes = inputs.export_call(2, seq)

    def export() -> torch.export.ExportedProgram:
        with registering_output_dataclasses(twin):  # a graph captured in another process: register them here too
            return torch.export.export(twin, args, kwargs, dynamic_shapes=shapes, strict=False)

    return cached_export(twin, args, kwargs, shapes, export)


def prime_export_cache(model: nn.Module, compute_dtype: torch.dtype = torch.float32) -> None:
    """Export ``model`` (token inputs) into this process's export cache, so that programs of it built here,
    or in processes forked from here, skip the export (``runtime/export_cache.py``)."""
    _exported_graph(model, compute_dtype, ModelInputs.tokens_only(model))


def export_model(model: nn.Module, graph: ModelGraph, ctx: RankContext,
                 inputs: ModelInputs | None = None) -> torch.fx.GraphModule:
    """What ``build_program`` exports and rewrites for ``ctx`` (``_export``): for its ``exported=`` argument."""
    return _export(model, graph, ctx, inputs or ModelInputs.tokens_only(model))


def _tokens_input(gm: torch.fx.GraphModule | PipelineSplit) -> ModelInputs:
    """The default inputs of a program built without ``inputs``: token ids under the graph's first input name."""
    if isinstance(gm, PipelineSplit):
        name = gm.layout.input_names[0]
    else:
        name = next(n.name for n in gm.graph.nodes if n.op == "placeholder")
    return ModelInputs((InputSpec(name, None, ("batch", "seq")),))


def _program_buffers(gm: torch.fx.GraphModule | PipelineSplit) -> dict[str, torch.Tensor]:
    """The program's buffers by their FQN in the model (pipeline stages' ``stage_<k>.`` prefix removed)."""
    out: dict[str, torch.Tensor] = {}
    for name, buffer in gm.named_buffers():
        if isinstance(gm, PipelineSplit):
            name = name.split(".", 1)[1]
        out.setdefault(name, buffer)
    return out


__all__ = ["Program", "StepResult", "build_program", "compile_allowed", "prime_export_cache"]
