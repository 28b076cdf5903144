"""Per-rank program: export → passes → a module that trains its shards.

``build_program(model, graph, plan, cluster, train, ctx=None)``:

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

Pipeline parallelism (pp > 1, ``runtime/pipeline.py``): ``step`` runs the
plan's schedule (GPipe / 1F1B / interleaved 1F1B) over the same
micro-batches; the last stage computes ``loss_fn`` and the mean micro-batch
loss is all-reduced over pp, so every rank returns the same ``StepResult``.
Clipping needs no pp-specific term: stages hold disjoint parameters and the
optimizer's norm all-reduce spans the world. ``forward(tokens)`` runs the
stages in order without autograd and returns the full outputs on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.export import Dim

from autoshard.errors import PlanError
from autoshard.graph import ModelGraph
from autoshard.passes import run_passes
from autoshard.passes._graph_utils import META_KEY, retarget_device
from autoshard.passes.context import ParamPlacement, RankContext
from autoshard.passes.schedule_overlap import compile_options
from autoshard.passes.split_pipeline import PipelineSplit
from autoshard.plan import Plan
from autoshard.runtime import collectives
from autoshard.runtime.compile_regions import REGIONS, insert_region_breaks
from autoshard.runtime.inductor_fallback import overlap_on, overlap_safe_backend
from autoshard.runtime.pipeline import PipelineEngine
from autoshard.runtime.materialize import Wanted, bind_source, fill, meta_twin
from autoshard.runtime.memory_report import BuildMemory, MemoryReport
from autoshard.runtime.mesh import build_device_mesh, build_rank_context, check_world
from autoshard.runtime.optimizer import OptimizerConfig, ShardedOptimizer
from autoshard.train import TrainSpec

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
                 *, overlap_grad_sync: bool = False, compile_regions: str = "stem", compile_overlap: str | None = None,
                 compile_backend: str | Callable = "inductor"):
        self.gm, self.plan, self.ctx, self.optimizer = gm, plan, ctx, optimizer
        self.build_memory = BuildMemory(torch.device(ctx.device))  # build_program replaces it with the measured one
        self.param_placements: dict[str, ParamPlacement] = gm.meta[META_KEY]["placements"]
        name = gm.meta[META_KEY].get("regather")
        self.regather = gm.get_submodule(name) if name else None
        self.pipeline = PipelineEngine(gm, ctx, plan.schedule, self.regather) if isinstance(gm, PipelineSplit) else None
        if self.pipeline is None and overlap_grad_sync:
            optimizer.enable_overlap()  # DP gradient buckets reduce under the last micro-batch's backward
        self._run = self.gm
        self.compile_options: dict | None = None  # what the compiled program was compiled with (None: eager)
        if compile_regions not in REGIONS:
            raise PlanError(f"compile_regions={compile_regions!r}: allowed {list(REGIONS)}")
        if ctx.compiled:
            # pp > 1: each local stage compiles on its own (runtime/pipeline.py)
            modules = [gm.stage(k) for k in gm.layout.local_stages] if self.pipeline is not None else [self.gm]
            if compile_regions != "graph":  # runtime/compile_regions.py
                for module in modules:
                    insert_region_breaks(module, compile_regions)
            self.compile_options = gm.meta[META_KEY].get("compile_options") or compile_options(plan, ctx.device)
            if compile_overlap is not None:
                self.compile_options = compile_options(plan, ctx.device, compile_overlap)
            inductor = _known_inductor_options(self.compile_options["inductor"]) if compile_backend == "inductor" else None
            backend: str | Callable = compile_backend
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

    def forward(self, tokens: torch.Tensor) -> Any:
        """Run the per-rank graph on ``tokens`` [B, S] (outputs as the model returns them).

        With pp > 1: no autograd; every rank gets the full outputs (module docstring).
        """
        if self.pipeline is not None:
            return self.pipeline.forward({self.pipeline.layout.input_names[0]: tokens})
        tokens = tokens.to(self.ctx.device)
        if self.regather is None:
            return self._run(tokens)
        with self.regather.hooks():
            return self.gm(tokens)

    __call__ = forward

    def local_batch(self, global_tokens: torch.Tensor) -> torch.Tensor:
        """This rank's dp slice of a global batch [B, S] (rows chunked by the combined dp coordinate)."""
        dp = self.ctx.size("dp")
        if global_tokens.shape[0] % dp:
            raise PlanError(f"global batch {global_tokens.shape[0]} is not divisible by dp={dp}; use a multiple of {dp}")
        return global_tokens.chunk(dp, 0)[self.ctx.coord("dp")]

    def step(self, tokens: torch.Tensor, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> StepResult:
        """Forward/backward over micro-batches of ``tokens``, then one optimizer step (module docstring)."""
        m = self.plan.schedule.num_micro_batches
        if tokens.shape[0] % m:
            raise PlanError(
                f"local batch {tokens.shape[0]} is not divisible by num_micro_batches={m}; "
                f"pass a multiple of {m} rows per rank"
            )
        if self.pipeline is not None:
            total = self.pipeline.train_step({self.pipeline.layout.input_names[0]: tokens}, tokens, loss_fn)
        else:
            total = self._accumulate(tokens, loss_fn)
        if self.ctx.size("dp") > 1:
            total = collectives.all_reduce(total.reshape(1), self.ctx.group("dp"), "avg")[0]
        norm = self.optimizer.step()
        return StepResult(loss=float(total), grad_norm=norm, lr=self.optimizer.last_lr)

    def _accumulate(self, tokens: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Forward/backward of every micro-batch on one stage; the mean micro-batch loss ([] fp32)."""
        m = self.plan.schedule.num_micro_batches
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for i, micro in enumerate(tokens.chunk(m, 0)):
            loss = loss_fn(self.forward(micro), micro.to(self.ctx.device)) / m
            if i == m - 1:
                self.optimizer.arm()  # overlapped gradient sync: this backward completes every gradient
            loss.backward()
            if self.regather is not None:
                self.regather.reset()
            total += loss.detach().float()
        return total

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


def build_program(
    model: nn.Module,
    graph: ModelGraph,
    plan: Plan,
    cluster: Any = None,
    train: TrainSpec | None = None,
    *,
    ctx: RankContext | None = None,
    optimizer: OptimizerConfig | None = None,
    device: str = "cpu",
    overlap_grad_sync: bool = False,
    compile_graph: bool | str = "auto",
    compile_regions: str = "stem",
    compile_overlap: str | None = None,
    compile_backend: str | Callable = "inductor",
    weights: Any = None,
    release_model: bool = False,
    track_memory: bool = False,
) -> Program:
    """This rank's ``Program`` for ``plan`` (module docstring: the five steps).

    ``weights``: where this rank's shards come from (``runtime/materialize.py``): ``None`` = the
    model's own parameters when they hold data, else initialised on shards (``Initialize(seed=0)``);
    a path (autoshard checkpoint directory, ``.safetensors`` file, Hugging Face safetensors
    directory); or a source (``Initialize``, ``Safetensors``, ``Checkpoint``, ``FromModule``). The
    model may live on the meta device; no rank ever holds a whole parameter its plan shards.
    ``release_model``: swap each of the model's parameters for a meta tensor once read (the model is
    otherwise left unchanged). ``optimizer``: the runtime's hyper-parameters (``OptimizerConfig``);
    ``None`` = ``train``'s (``OptimizerConfig.from_train``: optimizer, schedule, clipping). ``track_memory``: on a CPU, count live tensor bytes during the build
    (``runtime/live_bytes.py``) for ``Program.memory_report``; CUDA builds always report.
    ``overlap_grad_sync``: reduce DP gradient buckets during the last micro-batch's backward
    (``runtime/optimizer.py``, "Overlapped gradient sync"; pp = 1 only). Off by default: on 4×H100
    it made the searched DP plans slower (docs/runtime.md, "Overlapped gradient sync").
    ``compile_graph``: trace forward and backward of the per-rank graph jointly with
    ``torch.compile`` (pp > 1: each local stage compiles, ``runtime/pipeline.py``). The passes then emit the traced forms
    (``RankContext.compiled``): ZeRO-3 gathers, their re-gathers in backward and their
    reduce-scatters are functional-collective nodes of the joint graph that inductor schedules
    (``passes/_zero3.py`` note "compiled gather"; no saved-tensor hooks), with the overlap passes
    ``schedule_overlap`` chose from the plan (``compile_overlap`` overrides: "scheduler",
    "reorder", "none"). ``"auto"`` (the default) compiles exactly when ``compile_allowed``: a CUDA
    device and a plan with ep = cp = 1. On the CPU the graph stays eager by default (the gloo
    suite's speed). ``compile_backend``: ``torch.compile``'s backend ("inductor"; the CPU tests also
    use "aot_eager", the same joint graph and partition without code generation).
    ``compile_regions``: ``"stem"`` (default) compiles the prologue and the blocks onward as two
    graphs, ``"block"`` each block as its own, ``"graph"`` the whole program as one
    (``runtime/compile_regions.py``).
    """
    precision = train.precision if train is not None else plan.precision
    _check_plan(plan, graph)
    check_world(plan.mesh)
    device_mesh = None
    if ctx is None:
        ctx, device_mesh = build_rank_context(plan.mesh, device=device, compute_dtype=_DTYPES[precision])
    ctx = dataclasses.replace(ctx, compiled=_compiles(compile_graph, plan, ctx.device))
    build_memory = BuildMemory(torch.device(ctx.device), track_memory)
    with build_memory:
        reader = bind_source(weights, model, release=release_model)
        gm = run_passes(_export(model, graph, ctx), plan, ctx)
        placements = gm.meta[META_KEY]["placements"]
        params = gm.local_parameters() if isinstance(gm, PipelineSplit) else dict(gm.named_parameters())
        config = optimizer or (OptimizerConfig.from_train(train) if train is not None
                               else OptimizerConfig(name=plan.optimizer))
        grad_comm = gm.meta[META_KEY].get("grad_comm")  # quantize_comm: wire dtype of gradient syncs
        sharded = ShardedOptimizer(params, placements, None, ctx, config, grad_comm,
                                   bucket_bytes=plan.schedule.bucket_bytes,
                                   reduced_in_graph=gm.meta[META_KEY].get("grads_reduced_in_graph", ()))
        if hasattr(reader, "mesh"):  # a DCP checkpoint reads through DTensors over the plan's mesh
            reader.mesh = device_mesh or build_device_mesh(plan.mesh, torch.device(ctx.device).type)
        wanted = [Wanted(fqn, placements[fqn].global_shape, placements[fqn].region(ctx), placements[fqn])
                  for fqn in params]
        expected = {fqn: placement.global_shape for fqn, placement in placements.items()}
        fill(reader, wanted, expected, _program_buffers(gm), torch.device(ctx.device),
             lambda fqn, values: sharded.slots[fqn].load_master(values))
    program = Program(gm, plan, ctx, sharded, overlap_grad_sync=overlap_grad_sync, compile_regions=compile_regions,
                      compile_overlap=compile_overlap, compile_backend=compile_backend)
    program.build_memory = build_memory
    return program


def compile_allowed(plan: Plan, device: Any) -> bool:
    """Whether ``compile_graph="auto"`` compiles ``plan`` on ``device``: CUDA and ``plan.compilable``
    (ep = cp = 1; ``compile_graph=True`` still compiles ep/cp plans)."""
    return torch.device(device).type == "cuda" and plan.compilable


def _compiles(compile_graph: bool | str, plan: Plan, device: Any) -> bool:
    """Resolve ``build_program``'s ``compile_graph`` for ``plan`` (``PlanError`` where it cannot)."""
    if compile_graph not in (True, False, "auto"):
        raise PlanError(f"compile_graph={compile_graph!r}: allowed True, False, 'auto'")
    if compile_graph == "auto":
        return compile_allowed(plan, device)
    return bool(compile_graph)  # pp > 1: every local stage compiles (runtime/pipeline.py)


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


def _export(model: nn.Module, graph: ModelGraph, ctx: RankContext) -> torch.fx.GraphModule:
    """``torch.export`` of ``model``'s meta twin in the compute dtype (dynamic batch/seq), retargeted to ``ctx.device``.

    No weight is read or copied: the twin has the model's structure with meta tensors
    (``materialize.meta_twin``), so a model on the GPU is not duplicated and one on the meta device
    exports as well. The twin is cast to the compute dtype *before* export: export bakes the dtypes
    it sees into the graph (``_assert_tensor_metadata`` checks, explicit casts such as a norm's
    ``.to(x.dtype)``). It also bakes in the device (factory calls, metadata checks), which
    ``retarget_device`` points at the rank's device.
    """
    twin = meta_twin(model).to(ctx.compute_dtype)
    seq = min(8, getattr(getattr(model, "config", None), "max_seq_len", 8))
    tokens = torch.zeros(2, seq, dtype=torch.long, device="meta")
    exported = torch.export.export(twin, (tokens,), dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},), strict=False)
    gm = exported.module()
    retarget_device(gm, torch.device("meta"), torch.device(ctx.device))
    owners = {p.name: (layer.name, p.tp_role) for layer in graph.layers for p in layer.params}
    gm.meta[META_KEY] = {"params": owners}
    return gm


def _program_buffers(gm: torch.fx.GraphModule | PipelineSplit) -> dict[str, torch.Tensor]:
    """The program's buffers by their FQN in the model (pipeline stages' ``stage_<k>.`` prefix removed)."""
    out: dict[str, torch.Tensor] = {}
    for name, buffer in gm.named_buffers():
        if isinstance(gm, PipelineSplit):
            name = name.split(".", 1)[1]
        out.setdefault(name, buffer)
    return out


__all__ = ["Program", "StepResult", "build_program", "compile_allowed"]
