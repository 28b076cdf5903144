"""What each data-parallel state strategy does in a step, declared once.

``data_parallel_form`` says, for one layer's ZeRO state on a mesh and schedule, how the runtime holds
its parameters and which data-parallel collectives it issues per step: kind, mesh axis, payload,
how often, in which phase and under which compute it may hide. Two readers:

- the cost model prices these collectives (``search/layer_terms._dp_group_terms``: one time term
  per entry, hidden under the compute of ``hides_under`` or exposed when it is ``None``) and the
  resident state (``search/layer_terms.memory_state``);
- the passes decide from them where a layer's parameters live and which reductions are graph
  nodes (``passes/context.placement_for``: ``held``; ``passes/insert_collectives.py``: the
  in-graph gradient all-reduce and HSDP's replica all-reduce).

``tests/test_conformance.py`` runs every form on gloo and checks that the collectives the runtime
issues in a step (intercepted: kind, group, count, bytes) are exactly the declared ones.

The forms (D = dp, S = dp_shard, R = dp_replicate; "compiled m = 1": a compiled program with one
micro-batch on one stage, ``Plan.compilable`` on a GPU; wires unquantized unless said):

| state | held | gradient | collectives per step |
| --- | --- | --- | --- |
| replicate | full | full | all-reduce over D: in the backward graph (compiled m = 1), else after the backward |
| zero1 / zero2, gathered in forward (compiled m = 1, R = 1) | dim-0 shard over S | shard | all-gather over S in the forward graph (kept for backward), reduce-scatter over S in the backward graph |
| zero1 / zero2, compiled m = 1, R > 1 | full | full, own chunk kept | all-reduce over D in the backward graph; all-gather over D after the update |
| zero1 / zero2 / offload, otherwise | full | full, accumulated over micro-batches | reduce-scatter over D after the backward; all-gather over D after the update |
| zero3 | dim-0 shard over S | shard | per micro-batch: all-gather over S in forward, again in backward (not for an embedding, whose backward needs no weight, where compiled or on a quantized wire; the eager unquantized gather re-gathers it too), reduce-scatter over S in backward |
| zero3 with R > 1 (HSDP) | as zero3 | as zero3 | + all-reduce over R of the shard's gradient: in the backward graph (compiled m = 1), else after the backward |

Resident when (``DataParallelForm.optimizer``, ``gathered``, ``build``; priced by
``search/layer_terms.layer_memory`` with the rows of ``search/memory.model_state_memory``):

| state | optimizer state (fp32 master + moments) | full parameters beside the held ones | build reads at once |
| --- | --- | --- | --- |
| replicate | full | none | the full parameter |
| zero1 / zero2, gathered in forward | shard over S | kept from the layer's forward to its backward (saved like its activations) | the shard |
| zero1 / zero2, otherwise | its own 1/D chunk of the flat layer | none | the full parameter |
| offload | 1/D chunk, on the host | none | the full parameter |
| zero3 (and HSDP) | shard over S | transient: 1 + ``prefetch`` layers' gathers in flight, re-gathered in backward | the shard |

With dp = 1 every state holds everything (offload: its optimizer state on the host).

While one layer's backward runs (``DataParallelForm.backward``; ``search/memory.backward_buffer_bytes``,
p / g = parameter / gradient bytes per element, Ψ the layer's local parameters):

| form | backward | bytes | why |
| --- | --- | --- | --- |
| replicate, zero1 / zero2 / offload held full | ``none`` | 0 | gradients are the model states' own |
| zero3, eager (``passes/_zero3.py``) | ``gather_grad_copy`` | (p + 2g)Ψ | re-gathered weights, the unsharded gradient and the reduce-scatter's flat copy-in, live together |
| zero3, compiled | ``graph_gather`` | max(p + g, 2g)Ψ | the graph frees each gathered weight after its last use (the input gradient), before the flat copy-in exists |
| zero1 / zero2 gathered in forward | ``graph_kept`` | max(g, 2g − p)Ψ | the gradient, then its flat copy-in once the graph has freed the layer's kept weights (counted with its activations) |

Reductions "after the backward" are the optimizer's (``runtime/optimizer.py``), exposed: the
runtime's default (``BuildOptions.overlap_grad_sync`` False, measured faster on H100s) does not
start them during the backward. ZeRO-1 and ZeRO-2 differ only on quantized gradient wires (qgZ is allowed for ZeRO-2 and ZeRO-3);
this runtime's ZeRO-2 does not reduce per micro-batch. Scalar bookkeeping all-reduces (the loss
mean, the gradient norm for clipping) are not part of a layer's form.

Optimizer step (``step_working_set``; ``ShardedOptimizer.step``): what a layer's step holds beside
its model states, from the gradient sync to the write-back. The backward's gradient (``param.grad``,
the ``grads`` of the memory rows) stays alive until every bucket is reduced; the update reads an fp32
``slot.grad``, a tensor of its own where a collective after the backward produced it, where the
layer is flat (its own chunk) or where the compute dtype is not fp32. The fused AdamW kernel
(``torch._fused_adamw_``, CUDA and CPU alike) and SGD update in place: no temporaries on either
device. Buckets are packed in the gradient's dtype (``runtime/_buckets.py``). The cost model prices
these (``search/memory.py``, "Optimizer step"):

| form | fp32 gradient held through the step | packed bucket copies |
| --- | --- | --- |
| replicate, reduced after the backward | full | 1 (all-reduce: the concatenated bucket) |
| zero1 / zero2 / offload, flat (held full) | chunk 1/D (offload: on the host) | 2 (reduce-scatter: members padded, then concatenated); 0 when reduced in the graph |
| zero3 with R > 1, reduced after the backward | shard | 1 |
| reduced in the graph, or nothing to reduce (zero3 R = 1, gathered-in-forward ZeRO-1/2, dp = 1) | none in fp32; else full / shard as held | 0 |

After the update the flat states' re-gathers (at most ``gathers_in_flight`` buckets, each
its chunks, the gathered bucket and its copy-out) run without the backward's gradients, which
the sync freed: never more than the sync holds for D ≥ 2, so the sync is the step's peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.plan import LayerStrategy, Mesh, zero12_gathered_in_forward

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
PHASES = ("forward", "backward", "after_backward", "after_update")


@dataclass(frozen=True)
class Collective:
    """One data-parallel collective of a layer's step.

    kind: ``KINDS``. axis: the mesh axis it runs over (``"dp"``, ``"dp_shard"``, ``"dp_replicate"``).
    payload: ``"weight"`` (parameters on the ``weight_comm`` wire), ``"param"`` (parameters in the
    compute dtype), ``"grad"`` (gradients on the ``grad_comm`` wire); its bytes are those of the
    layer's full (unsharded) tensors, padded as the runtime pads them.
    per_micro_batch: issued once per micro-batch (else once per step).
    phase: ``PHASES``; in_graph: a node of the compiled graph (else issued by the runtime in Python).
    hides_under: the compute it may overlap (``"forward"``, ``"backward"``) or ``None`` (exposed).
    """

    kind: str
    axis: str
    payload: str
    per_micro_batch: bool
    phase: str
    in_graph: bool
    hides_under: str | None


@dataclass(frozen=True)
class DataParallelForm:
    """How the runtime runs one layer's state (module docstring table)."""

    state: str
    held: str  # "full" | "shard" (dim 0 over dp_shard) between steps
    grads: str  # "full" | "shard" when the optimizer takes them
    collectives: tuple[Collective, ...]
    # residency (module docstring, "Resident when"):
    optimizer: str = "full"  # AdamW moments and fp32 master: "full" | "chunk" (1/D flat) | "shard" | "host" (1/D)
    gathered: str = "none"  # full parameters beside the held ones: "none" | "kept" (forward to backward) | "transient"
    build: str = "full"  # what one rank reads at once while building a parameter: "full" | "shard"
    backward: str = "none"  # held while its backward runs (module docstring): "none" | "gather_grad_copy" | "graph_gather" | "graph_kept"

    def has(self, kind: str, axis: str | None = None, phase: str | None = None) -> bool:
        return any(c.kind == kind and axis in (None, c.axis) and phase in (None, c.phase) for c in self.collectives)


def data_parallel_form(strategy: LayerStrategy, mesh: Mesh, num_micro_batches: int, compiled: bool,
                       layer_kind: str = "") -> DataParallelForm:
    """The form of ``strategy.state`` (module docstring table). ``compiled``: the program is compiled
    (``RankContext.compiled``; the cost model: a GPU cluster and ``Plan.compilable``). ``layer_kind``:
    ``"embedding"`` has no ZeRO-3 re-gather in backward. Expert-parallel parameters are not covered
    (their gradient is all-reduced over the expert-data-parallel group, ``runtime/optimizer.py``)."""
    state, m = strategy.state, num_micro_batches
    if mesh.dp == 1:
        return DataParallelForm(state, "full", "full", (), optimizer="host" if state == "offload" else "full")
    one_step = compiled and m == 1 and mesh.pp == 1  # whole step in one graph: reductions can be nodes
    exact = strategy.grad_comm == "bf16" and strategy.weight_comm == "bf16"

    def c(kind, axis, payload, phase, *, per_mb=False, in_graph=False, hides=None):
        return Collective(kind, axis, payload, per_mb, phase, in_graph, hides)

    if state == "replicate":
        if one_step and exact:
            return DataParallelForm(state, "full", "full", (c("all_reduce", "dp", "grad", "backward", in_graph=True,
                                                              hides="backward"),))
        return DataParallelForm(state, "full", "full", (c("all_reduce", "dp", "grad", "after_backward"),))
    if state in ("zero1", "zero2", "offload"):
        if state != "offload" and zero12_gathered_in_forward(strategy, mesh, m, compiled):
            return DataParallelForm(state, "shard", "shard", (
                c("all_gather", "dp_shard", "param", "forward", in_graph=True, hides="forward"),
                c("reduce_scatter", "dp_shard", "grad", "backward", in_graph=True, hides="backward")),
                optimizer="shard", gathered="kept", build="shard", backward="graph_kept")
        gather = c("all_gather", "dp", "param", "after_update")
        flat = "host" if state == "offload" else "chunk"
        if state != "offload" and one_step and exact:
            return DataParallelForm(state, "full", "full", (
                c("all_reduce", "dp", "grad", "backward", in_graph=True, hides="backward"), gather), optimizer=flat)
        return DataParallelForm(state, "full", "full", (c("reduce_scatter", "dp", "grad", "after_backward"), gather),
                                optimizer=flat)
    # zero3
    hsdp_in_graph = one_step and exact
    gathers = [c("all_gather", "dp_shard", "weight", "forward", per_mb=True, in_graph=compiled, hides="forward")]
    # the eager unquantized (fused) gather is re-gathered for every layer; compiled and quantized (op-by-op)
    # gathers only where the backward reads the weight
    if layer_kind != "embedding" or not (compiled or not exact):
        gathers.append(c("all_gather", "dp_shard", "weight", "backward", per_mb=True, in_graph=compiled,
                         hides="backward"))
    reduce = [c("reduce_scatter", "dp_shard", "grad", "backward", per_mb=True, in_graph=compiled, hides="backward")]
    if mesh.dp_replicate > 1:
        reduce.append(c("all_reduce", "dp_replicate", "grad", "backward" if hsdp_in_graph else "after_backward",
                        in_graph=hsdp_in_graph, hides="backward" if hsdp_in_graph else None))
    return DataParallelForm(state, "shard", "shard", tuple(gathers + reduce), optimizer="shard", gathered="transient",
                            build="shard", backward="graph_gather" if compiled else "gather_grad_copy")


GRAD_COPIES = ("none", "full", "chunk", "shard")


@dataclass(frozen=True)
class StepWorkingSet:
    """What one layer's optimizer step holds beside its model states (module docstring, "Optimizer step").

    grad: ``GRAD_COPIES``: the fp32 gradient the update reads when it is a tensor of its own, the size
    of the layer's local parameters ("full"), of its flat 1/D chunk ("chunk") or of its dim-0 shard as
    held ("shard"); "none" where the update reads the backward's own gradient.
    pack: bucket-sized copies, in the gradient's dtype, alive while one bucket is packed and reduced
    after the backward (0: no reduction after the backward).
    """

    grad: str
    pack: int


def step_working_set(form: DataParallelForm, compute_fp32: bool) -> StepWorkingSet:
    """The optimizer step's working set of a layer run as ``form`` (module docstring table).
    ``compute_fp32``: the gradients are fp32 (``precision="fp32"``), so an unreduced one is the update's."""
    after = [c for c in form.collectives if c.phase == "after_backward"]
    flat = form.state in ("zero1", "zero2", "offload") and form.held == "full" and bool(form.collectives)
    size = "chunk" if flat else ("shard" if form.grads == "shard" else "full")
    pack = {"all_reduce": 1, "reduce_scatter": 2}[after[0].kind] if after else 0
    own_tensor = bool(after) or flat or not compute_fp32  # a collective's output, the own chunk, or an fp32 cast
    return StepWorkingSet(size if own_tensor else "none", pack)


__all__ = ["Collective", "DataParallelForm", "GRAD_COPIES", "KINDS", "PHASES", "StepWorkingSet", "data_parallel_form",
           "step_working_set"]
