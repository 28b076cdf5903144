"""What each model-parallel form does in a step, declared once: TP, SP, EP, PP, CP, quantized wires.

``autoshard/data_parallel.py`` declares a layer's data-parallel collectives; this module declares
the others, as the runtime runs them (``passes/insert_collectives.py``, ``passes/_expert_parallel.py``,
``runtime/pipeline.py``, ``runtime/program.py``, ``runtime/optimizer.py``,
``kernels/quantized_collectives.py``). Two readers:

- the cost model prices them (``search/layer_terms.critical_terms``: TP/SP/EP/CP per micro-batch on
  the critical path; ``search/cost_model.boundary_send_s``: the stage boundary;
  ``layer_terms.comm_bytes_per_element``: quantized wires);
- ``tests/test_conformance_mixed.py`` runs mixed plans on gloo and checks that the collectives the
  runtime issues in a step (kind, count, bytes, process group) are exactly the declared ones, the
  data-parallel forms included.

Per micro-batch of ``T`` tokens on a rank (``b·s``), ``h`` hidden, ``V`` vocabulary, ``t`` = tp,
sizes in elements of the compute dtype (payloads: ``PAYLOADS``; "AR" all-reduce, "AG" all-gather,
"RS" reduce-scatter, "A2A" all-to-all, each of the whole tensor, over tp unless said):

| form | layer | forward | backward |
| --- | --- | --- | --- |
| TP | attention, MLP: its column projections (f) | — | AR(T·h) of the input's gradient (shared by q/k/v, by gate/up) |
| TP | attention, MLP: its row projection (g) | AR(T·h) after the row linear | — |
| TP | embedding (vocab-parallel) | AR(T·h) of the masked partial rows (S·h for a batch-free positional table) | — |
| TP | head (vocab-parallel) | AG(T·V): the logits are gathered, the loss runs over all V on every tp rank | AR(T·h) (f) |
| SP | attention, MLP: its column projections | AG(T·h) before the column linear | RS(T·h) |
| SP | attention, MLP: its row projection | RS(T·h) after the row linear | AG(T·h) |
| SP | embedding | RS(T·h) | AG(T·h) |
| SP | head | AG(T·h) + AG(T·V) | RS(T·h) |
| SP | every tp-replicated parameter of an SP layer (norms, value head, row biases, router) | — | AR of its gradient, one per use (these layers use each once) |
| SP | value head (a model output) | AG of its output, T·out | — |
| EP | MoE (experts split over ep) | A2A(E·C·h) dispatch + A2A(E·C·h) combine over ep | the two reverse A2As |
| EP | MoE expert weights, per step | — | AR(sum) of the expert gradients over edp (= dp/ep), after the backward, bucketed |
| PP | each stage boundary, per value crossing it | send (stage k's rank) / recv (k+1's) of T·h (T·h/t under SP) over pp | the gradient back: send (k+1) / recv (k) |
| CP | attention | AG(K,V of the whole sequence) over cp | RS(dK,dV) |
| step | bookkeeping scalars, per step | — | AR of one fp32 scalar: the loss over pp (pp > 1), the loss mean over dp (dp > 1), the clipping norm over the world (world > 1) |

Notes, each what the runtime does:

* A layer runs the f side if it holds a ``column`` parameter and the g side if it holds a ``row`` one
  (``passes/insert_collectives.py``: f converts the column projection's replicated / sequence-sharded
  input, g the row projection's partial output). A whole attention or MLP module (the reference,
  Hugging Face and Llama-style blocks) holds both; a block whose projections are layers of their own
  (nanoGPT's ``qkv``, ``proj``, ``fc``, ``out``: ``passes/_capture_blocks.py``) splits them: ``qkv``
  and ``fc`` run f only, ``proj`` and ``out`` g only.
* SP's all-gather before the column projections (and the vocab-parallel head) is not repeated in the
  backward, as Megatron-LM repeats it: the gathered whole-sequence input is what the column linear saves
  for its weight gradient, so each such layer keeps ``T·h`` of it, not ``T·h/t``
  (``search/memory.sp_gathered_input_bytes``; the memory campaign in
  ``benchmarks/results/memory_h200_2026-11-27`` found them live at the step's peak).
* Every TP/SP/EP collective is a node of the per-rank graph (``in_graph``) and synchronous
  (``kernels/collectives.py``, note "synchronous kernels"): on the critical path, hidden under
  nothing. SP's parameter all-reduces run once per parameter per micro-batch (each use of a
  replicated parameter on sequence chunks is wrapped in ``copy_to_tp``), not once per step.
* The head's logits are all-gathered (``gather_logits``) before the user's loss; there is no
  vocab-parallel cross-entropy. Its backward keeps this rank's slice (no collective).
* SP is one decision for the whole model (the search's ``sp_consistent``): the runtime's sequence
  regions follow from the producing layers' ``sp``, so a plan mixing ``sp`` across layers is not
  declared here.
* EP moves the whole capacity buffer ``[E, C, h]`` both ways, empty slots included:
  ``C = T`` dropless (``capacity_factor=None``, the reference MoE's default: ``E/k`` times the
  routed tokens), else ``min(T, ⌈f·k·T/E⌉)`` (``autoshard/models/moe.py``). Capture does not record
  ``f``; the cost model reads ``E·C/T`` from the captured expert GEMMs, which run on that buffer
  (``expert_rows_per_token``). Expert weights need ``state="replicate"``, ``tp="none"``.
* PP: ``torch.distributed.pipelining`` sends every value produced on a stage ≤ k and used on a
  stage > k (``passes/split_pipeline.py``); a cut between blocks carries one (the residual stream),
  declared here. Counts do not depend on GPipe vs 1F1B; with interleaving every virtual-stage
  boundary crosses ranks. Under TP without SP every tp rank sends the whole activation.
* CP is declared for pricing only: the runtime refuses ``cp > 1`` (``build_program``) and the search
  does not enumerate it.

Quantized wires (ZeRO++; they change the data-parallel collectives of ``data_parallel_form``, per
``weight_comm`` / ``grad_comm``; ``wire_form``):

| wire | declared collective | runs as | bytes |
| --- | --- | --- | --- |
| ``bf16`` (weights or gradients) | any | the same | the compute dtype |
| ``fp32`` gradients | RS, AR | the same on the fp32 upcast | 4 per element |
| ``int8`` / ``fp8`` weights (qwZ, ZeRO-3 only) | AG (forward and backward re-gather) | AG of ``uint8`` rows | ``n`` rows of ``row_bytes(S)`` |
| ``int8`` / ``int4`` gradients (qgZ, ZeRO-2/3, offload) | RS | A2A of ``uint8`` rows | ``n`` rows of ``row_bytes(S)`` |
| ``int8`` / ``int4`` gradients | AR (HSDP's replica all-reduce) | A2A + AG of ``uint8`` rows | ``n`` rows of ``row_bytes(⌈N/n⌉)`` each |

``S`` = one rank's chunk (elements), ``row_bytes(S)`` = payload padded to whole blocks plus one fp32
scale per block, with the block in 64…512 that moves the fewest bytes (``quantized_row_bytes``):
scales travel in the same rows, no separate tensor. Quantized gradient syncs are not bucketed (one
per parameter). hpZ (a node-local secondary weight shard) exists as kernels
(``kernels/comm.py``) but no pass uses it: nothing runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.graph import LayerInfo
from autoshard.plan import LayerStrategy, Mesh

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "recv")
AXES = ("tp", "ep", "edp", "pp", "cp", "dp", "world")
PHASES = ("forward", "backward", "after_backward")
# What a collective moves (``payload_bytes``): the whole tensor, gathered / unreduced.
PAYLOADS = {
    "hidden": "one hidden-sized activation of the micro-batch, T·h",
    "logits": "the head's logits, T·V",
    "output": "the layer's output (a model output), T·output_bytes_per_token as captured",
    "replicated_params": "the gradient of each tp-replicated parameter of the layer (count = how many)",
    "expert_buffer": "the MoE capacity buffer, E·C·h",
    "expert_grads": "the layer's local expert gradients, Σ numel/ep",
    "boundary": "one activation crossing a stage boundary: T·h, T·h/t under SP",
    "kv": "K and V of the whole sequence, 2·T·cp·h·kv_heads/heads (/t when tp splits the heads)",
    "scalar": "one fp32 scalar",
}
TP_SPLIT_ROLES = ("column", "row", "vocab")
QUANT_BITS = {"int8": 8, "fp8": 8, "int4": 4}
QUANT_BLOCKS = (64, 128, 256, 512)  # elements per scale the runtime chooses among (fewest bytes, ties: larger)
QUANT_SCALE_BYTES = 4


@dataclass(frozen=True)
class Collective:
    """One model-parallel collective of a layer's micro-batch (or of the step, ``per_micro_batch=False``).

    kind: ``KINDS``. axis: ``AXES`` (``"edp"``: the dp ranks holding the same experts).
    payload: ``PAYLOADS`` (bytes: ``payload_bytes``, of all ``count`` collectives together).
    phase: ``PHASES``. in_graph: a node of the per-rank graph (else issued by the runtime
    in Python). hides_under: the compute it may overlap, or ``None`` (on the critical path).
    """

    kind: str
    axis: str
    payload: str
    phase: str
    count: int = 1
    per_micro_batch: bool = True
    in_graph: bool = True
    hides_under: str | None = None


def _tp_split(layer: LayerInfo) -> bool:
    """Megatron TP splits the layer: column/row/vocab parameters, or the LM head (vocab-parallel even with
    its weight tied to the embedding; ``search/memory.tp_shardable``)."""
    return layer.kind == "head" or any(p.tp_role in TP_SPLIT_ROLES for p in layer.params)


def _replicated(layer: LayerInfo) -> list:
    return [p for p in layer.params if p.tp_role not in TP_SPLIT_ROLES + ("expert",)]


def _megatron_f_g(layer: LayerInfo, sp: bool) -> list[Collective]:
    """f for a layer with column projections, g for one with a row projection (module docstring note)."""
    roles = {p.tp_role for p in layer.params}
    out = []
    if "column" in roles:  # f: the replicated input (SP: the sequence chunks) of the column projections
        out += ([Collective("all_gather", "tp", "hidden", "forward"),
                 Collective("reduce_scatter", "tp", "hidden", "backward")] if sp
                else [Collective("all_reduce", "tp", "hidden", "backward")])
    if "row" in roles:  # g: the row projection's partial sums
        out += ([Collective("reduce_scatter", "tp", "hidden", "forward"),
                 Collective("all_gather", "tp", "hidden", "backward")] if sp
                else [Collective("all_reduce", "tp", "hidden", "forward")])
    return out


def tensor_parallel_form(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh) -> tuple[Collective, ...]:
    """The layer's TP/SP collectives of one micro-batch (module docstring table)."""
    if mesh.tp == 1:
        return ()
    sp = strategy.sp
    out: list[Collective] = []
    if strategy.tp == "megatron" and _tp_split(layer):
        if layer.kind == "embedding":
            out += ([Collective("reduce_scatter", "tp", "hidden", "forward"),
                     Collective("all_gather", "tp", "hidden", "backward")] if sp
                    else [Collective("all_reduce", "tp", "hidden", "forward")])
        elif layer.kind == "head":
            out += [Collective("all_gather", "tp", "logits", "forward")]
            out += ([Collective("all_gather", "tp", "hidden", "forward"),
                     Collective("reduce_scatter", "tp", "hidden", "backward")] if sp
                    else [Collective("all_reduce", "tp", "hidden", "backward")])
        else:
            out += _megatron_f_g(layer, sp)
    if sp:
        if _replicated(layer):
            out.append(Collective("all_reduce", "tp", "replicated_params", "backward", count=len(_replicated(layer))))
        if layer.kind == "value_head":
            out.append(Collective("all_gather", "tp", "output", "forward"))
    return tuple(out)


def expert_parallel_form(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh) -> tuple[Collective, ...]:
    """The layer's EP collectives: dispatch and combine per micro-batch, the expert gradients per step."""
    if not (strategy.ep and mesh.ep > 1 and any(p.tp_role == "expert" for p in layer.params)):
        return ()
    out = [Collective("all_to_all", "ep", "expert_buffer", phase, count=2) for phase in ("forward", "backward")]
    if mesh.dp // mesh.ep > 1:
        out.append(Collective("all_reduce", "edp", "expert_grads", "after_backward", per_micro_batch=False,
                              in_graph=False))
    return tuple(out)


def context_parallel_form(layer: LayerInfo, mesh: Mesh) -> tuple[Collective, ...]:
    """Attention's K,V all-gather and dK,dV reduce-scatter over cp (priced only: the runtime refuses cp > 1)."""
    if mesh.cp == 1 or layer.kind != "attention":
        return ()
    return (Collective("all_gather", "cp", "kv", "forward"), Collective("reduce_scatter", "cp", "kv", "backward"))


def model_parallel_form(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh) -> tuple[Collective, ...]:
    """Every TP/SP, EP and CP collective of ``layer`` (module docstring table)."""
    return (tensor_parallel_form(layer, strategy, mesh) + expert_parallel_form(layer, strategy, mesh)
            + context_parallel_form(layer, mesh))


def stage_boundary_form(sends: bool) -> tuple[Collective, ...]:
    """One value crossing a stage boundary, per micro-batch, on the rank that ``sends`` it forward (its
    gradient comes back) or on the rank that receives it (and sends the gradient back)."""
    first, second = ("send", "recv") if sends else ("recv", "send")
    return (Collective(first, "pp", "boundary", "forward"), Collective(second, "pp", "boundary", "backward"))


def step_scalars(mesh: Mesh) -> tuple[Collective, ...]:
    """The bookkeeping all-reduces of one step (``runtime/program.py``, ``runtime/pipeline.py``,
    ``runtime/optimizer.py``): the last stage's loss over pp, the loss mean over dp, the clipping norm."""
    axes = [axis for axis, size in (("pp", mesh.pp), ("dp", mesh.dp), ("world", mesh.world_size)) if size > 1]
    return tuple(Collective("all_reduce", axis, "scalar", "after_backward", per_micro_batch=False, in_graph=False)
                 for axis in axes)


def expert_rows_per_token(layer: LayerInfo) -> float:
    """``E·C/T``: rows of the MoE capacity buffer per token, read from the captured expert GEMMs (their
    FLOPs per token, the router's taken out, over the ``2·params`` of one expert per row): ``E`` for the
    reference MoE dropless, ``≈ f·k`` with a capacity factor ``f``, ``k`` for a routed (grouped-GEMM) graph.
    ``top_k`` when the layer has no expert parameters to read it from."""
    expert = sum(p.numel for p in layer.params if p.tp_role == "expert")
    router = 2.0 * sum(p.numel for p in layer.params if p.tp_role != "expert")
    if not expert or layer.matmul_flops_per_token <= router:
        return float(layer.top_k or 1)
    return (layer.matmul_flops_per_token - router) / (2.0 * expert / (layer.num_experts or 1))


def payload_bytes(c: Collective, layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh, tokens: float,
                  element_bytes: float, rows_per_token: float | None = None, seq_len: float | None = None) -> float:
    """Bytes of ``c`` (all ``count`` of them) for a micro-batch of ``tokens`` (``b·s/cp``) on one rank.

    ``seq_len``: the micro-batch's sequence length on a rank (``s/cp``): the rows of the hidden payload of a
    layer whose output has no batch dim (``LayerInfo.batch_free_output``: a positional table of ``arange(s)``).

    ``element_bytes``: the compute dtype's. Where capture did not record ``hidden`` / ``vocab``, its
    per-token bytes stand in (the head's input, another layer's output; at capture's dtype).
    ``rows_per_token``: ``E·C/T`` of an MoE layer's capacity buffer (``autoshard/models/moe.py``,
    ``expert_capacity``); by default ``expert_rows_per_token``.
    """
    t = mesh.tp
    hidden = layer.hidden * element_bytes if layer.hidden else (
        layer.input_bytes_per_token if layer.kind == "head" else layer.output_bytes_per_token)
    if c.payload == "hidden":
        return (seq_len if layer.batch_free_output and seq_len else tokens) * hidden
    if c.payload == "logits":
        return tokens * (layer.vocab * element_bytes if layer.vocab else layer.output_bytes_per_token)
    if c.payload == "output":
        return tokens * layer.output_bytes_per_token
    if c.payload == "replicated_params":
        return sum(p.numel for p in _replicated(layer)) * element_bytes
    if c.payload == "expert_buffer":
        routed = tokens / t if strategy.sp and t > 1 else tokens  # under SP the layer sees its sequence chunk
        rows = expert_rows_per_token(layer) if rows_per_token is None else rows_per_token
        return c.count * rows * routed * hidden  # dispatch and combine move the same [E, C, h] buffer
    if c.payload == "expert_grads":
        return sum(p.numel for p in layer.params if p.tp_role == "expert") / mesh.ep * element_bytes
    if c.payload == "boundary":
        return tokens * hidden / (t if strategy.sp and t > 1 else 1)
    if c.payload == "kv":
        ratio = layer.num_kv_heads / layer.num_heads if layer.num_heads and layer.num_kv_heads else 1.0
        split = t if strategy.tp == "megatron" and _tp_split(layer) else 1
        return tokens * mesh.cp * 2.0 * hidden * ratio / split
    if c.payload == "scalar":
        return 4.0
    raise ValueError(f"payload {c.payload!r}: allowed {tuple(PAYLOADS)}")


# ---- quantized wires ------------------------------------------------------------------------------


def quantized_row_bytes(shard_elements: int, wire: str) -> int:
    """Bytes of one rank's row of a quantized collective: ``shard_elements`` padded to whole blocks at
    ``QUANT_BITS[wire]`` bits, plus one fp32 scale per block, for the block of ``QUANT_BLOCKS`` that
    moves the fewest bytes (ties: the larger; ``runtime/quantized_collectives.block_for``)."""
    bits = QUANT_BITS[wire]
    best = None
    for block in QUANT_BLOCKS:
        blocks = -(-shard_elements // block)
        nbytes = blocks * block * bits // 8 + QUANT_SCALE_BYTES * blocks
        best = nbytes if best is None or nbytes <= best else best
    return best


def wire_bytes_per_element(wire: str, element_bytes: float) -> float:
    """Bytes per element of a large tensor on ``wire`` (``"bf16"``: the compute dtype's
    ``element_bytes``): quantized wires at the largest block, scales included."""
    if wire == "bf16":
        return element_bytes
    if wire == "fp32":
        return 4.0
    return QUANT_BITS[wire] / 8 + QUANT_SCALE_BYTES / QUANT_BLOCKS[-1]


def wire_form(kind: str, wire: str, elements: int, num_ranks: int, element_bytes: int) -> tuple[tuple[str, int], ...]:
    """(kind, bytes) of the collectives that run for one declared ``kind`` of ``elements`` (the whole
    tensor; a multiple of ``num_ranks`` for all-gather and reduce-scatter) on ``wire`` (module table)."""
    if wire not in QUANT_BITS:
        return ((kind, elements * (4 if wire == "fp32" else element_bytes)),)
    row = quantized_row_bytes(-(-elements // num_ranks), wire)
    if kind == "all_gather":
        return (("all_gather", num_ranks * row),)
    if kind == "reduce_scatter":
        return (("all_to_all", num_ranks * row),)
    return (("all_to_all", num_ranks * row), ("all_gather", num_ranks * row))


__all__ = [
    "AXES",
    "KINDS",
    "PAYLOADS",
    "PHASES",
    "Collective",
    "context_parallel_form",
    "expert_rows_per_token",
    "expert_parallel_form",
    "model_parallel_form",
    "payload_bytes",
    "quantized_row_bytes",
    "stage_boundary_form",
    "step_scalars",
    "tensor_parallel_form",
    "wire_bytes_per_element",
    "wire_form",
]
