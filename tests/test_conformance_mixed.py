"""Conformance of mixed plans: every collective the runtime issues in a step is a declared one.

Each plan runs one step on gloo (world 2 and 4, tiny models, seq 8, fp32) after a first step, with
``torch.profiler`` recording every collective the process groups run (kind, tensor sizes and dtype)
and each process group's sequence number counting the collectives it ran. Declared, for the rank:

* per layer of its pipeline stages: ``data_parallel_form`` over the layer's parameters (expert
  weights under EP excluded: ``expert_parallel_form`` declares theirs), with the bytes of the
  tp/ep-local tensors padded as the runtime pads them (``tests/test_conformance.py``), on the
  layer's wires (``model_parallel.wire_form``: qwZ/qgZ change kind and bytes); and
  ``model_parallel_form`` (TP/SP/EP) with ``payload_bytes``, × micro-batches when per micro-batch;
* per stage boundary of its stages: ``stage_boundary_form`` (send/recv, sender or receiver side);
* per step: ``step_scalars`` (loss over pp and dp, clipping norm);
* the optimizer's per-step reductions and gathers outside the graph go out in buckets, one per
  (kind, axis) (``bucket_bytes`` above the model).

Checked: per kind (all-gather, reduce-scatter, all-reduce, all-to-all, send, recv) the count and the
bytes, and per process group the count (a group stands for the axes it serves: on a small mesh one
group can be several axes). The profiler does not name the group of a collective; the sequence
numbers do, per group.

Plans (eager, two micro-batches, unless said): world 2: TP2; TP2+SP; TP2+SP compiled (aot_eager, one
micro-batch); EP2 with a capacity factor (dp 2 = ep 2); ZeRO-3 with qwZ int8 + qgZ int8; ZeRO-2 with
qgZ int4; PP2 interleaved 1F1B (4 virtual stages). World 4: DP2×TP2 (blocks ZeRO-3, the rest DDP);
PP2×TP2+SP GPipe; PP2×DP2×EP2 (dropless, the dense layers ZeRO-1); DP4×EP2 (expert gradients
all-reduced over edp = 2; the dense layers ZeRO-2, one micro-batch). User blocks (world 2): NanoPolicy
(``tests/_user_models.py``) at TP2 and TP2+SP, whose ``qkv`` / ``fc`` layers hold only column projections
(f only) and ``proj`` / ``out`` only row ones (g only), whose ``pos`` embeds ``arange(S)`` (a batch-free
``[S, h]`` output: its vocab-parallel collectives move S·h) and whose ``critic`` is a value head.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import tempfile

import pytest

from _harness import run_gloo_cases
from _tiers import sample
from _runtime_cases import BATCH, OPT, SEQ, batches, loss_fn
from _user_models import NanoPolicy

from autoshard import model_parallel as mp
from autoshard.data_parallel import data_parallel_form
from autoshard.models import build
from autoshard.models.moe import expert_capacity
from autoshard.passes import capture
from autoshard.passes.context import TP_ROLE_DIM
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import BuildOptions, build_program
from autoshard.train import TrainSpec

BIG_BUCKET = 1 << 30
MODELS = {"llama": ("llama:tiny", {}), "moe": ("moe:tiny", {}), "moe_capacity": ("moe:tiny", {"capacity_factor": 1.0}),
          "nano": (NanoPolicy, {})}  # a registry spec, or a user's module class (tests/_user_models.py)
_TYPE_BYTES = {"float": 4, "unsigned char": 1, "c10::BFloat16": 2, "long int": 8}


def _model(model: str):
    spec, overrides = MODELS[model]
    return build(spec, **overrides) if isinstance(spec, str) else spec(**overrides)


@functools.lru_cache(maxsize=None)
def _graph(model: str):
    return capture(_model(model), seq_lens=(8, 16))


def _stage(layer: str, stages: int) -> int:
    """Stage of ``layer`` among ``stages`` (1, 2 or 4) for the 2-block tiny models: 2 cuts at the block,
    4 also after each block's attention."""
    if stages == 1:
        return 0
    if layer.startswith("blocks."):
        block, part = int(layer.split(".")[1]), layer.split(".")[2]
        return block if stages == 2 else 2 * block + (part not in ("attn_norm", "attn"))
    return 0 if layer == "embed" else stages - 1


@dataclasses.dataclass(frozen=True)
class Case:
    """One mixed plan: model, mesh, strategy fields per layer name, micro-batches, schedule."""

    model: str
    mesh: Mesh
    choose: object  # layer name -> strategy fields
    micro_batches: int = 2
    schedule: str = "1f1b"
    virtual: int = 1
    compiled: bool = False

    def plan(self) -> Plan:
        graph = _graph(self.model)
        stages = self.mesh.pp * self.virtual
        layers = tuple(LayerStrategy(layer=layer.name, stage=_stage(layer.name, stages), **self.choose(layer.name))
                       for layer in graph.layers)
        return Plan(model_name=graph.model_name, mesh=self.mesh, layers=layers,
                    schedule=Schedule(name=self.schedule, num_micro_batches=self.micro_batches,
                                      virtual_stages=self.virtual, bucket_bytes=BIG_BUCKET))


def _tp(name):
    return {"tp": "megatron"}


def _tp_sp(name):
    return {"tp": "megatron", "sp": True}


def _zero3_blocks_tp(name):
    return {"tp": "megatron", "state": "zero3" if name.startswith("blocks.") else "replicate"}


def _qwz_qgz(name):
    return {"state": "zero3", "weight_comm": "int8", "grad_comm": "int8"}


def _qgz_int4(name):
    return {"state": "zero2", "grad_comm": "int4"}


def _ep(name):
    return {"ep": name.endswith("moe")}


def _ep_zero1_rest(name):
    return {"ep": True} if name.endswith("moe") else {"state": "zero1"}


def _ep_zero2_rest(name):
    return {"ep": True} if name.endswith("moe") else {"state": "zero2"}


def _replicate(name):
    return {}


CASES_2 = {
    "tp2": Case("llama", Mesh(tp=2), _tp),
    "tp2_sp": Case("llama", Mesh(tp=2), _tp_sp),
    "tp2_sp_compiled": Case("llama", Mesh(tp=2), _tp_sp, micro_batches=1, compiled=True),
    "ep2_capacity": Case("moe_capacity", Mesh(dp_shard=2, ep=2), _ep),
    "zero3_qwz_qgz": Case("llama", Mesh(dp_shard=2), _qwz_qgz),
    "zero2_qgz_int4": Case("llama", Mesh(dp_shard=2), _qgz_int4),
    "pp2_interleaved": Case("llama", Mesh(pp=2), _replicate, schedule="interleaved_1f1b", virtual=2),
}
CASES_4 = {
    "dp2_tp2_zero3_blocks": Case("llama", Mesh(dp_shard=2, tp=2), _zero3_blocks_tp),
    "pp2_tp2_sp_gpipe": Case("llama", Mesh(pp=2, tp=2), _tp_sp, schedule="gpipe"),
    "pp2_dp2_ep2_zero1": Case("moe", Mesh(pp=2, dp_shard=2, ep=2), _ep_zero1_rest),
    "dp4_ep2_zero2": Case("moe", Mesh(dp_shard=4, ep=2), _ep_zero2_rest, micro_batches=1),  # edp = 2
}
# a nanoGPT block whose qkv / proj / fc / out are layers of their own: column-only layers run f, row-only g
# `make test` (tests/_tiers.py): TP 2 + SP issues every collective TP 2 does, and more
CASES_2 = sample(CASES_2, [name for name in CASES_2 if name != "tp2"])
CASES_USER = {
    "nano_tp2": Case("nano", Mesh(tp=2), _tp),
    "nano_tp2_sp": Case("nano", Mesh(tp=2), _tp_sp),
}


# ---- the child: what the runtime issues --------------------------------------------------------


def _issued(rank, world_size, case: Case):
    """Collectives of the second step: {kind: [count, bytes]}, {group name: count}, and this rank's view."""
    from torch.profiler import ProfilerActivity, profile

    from autoshard.kernels.collectives import _group

    program = build_program(_model(case.model), _graph(case.model), case.plan(),
                            TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"), optimizer=OPT,
                            options=BuildOptions(compile=case.compiled, backend="aot_eager"))
    ctx = program.ctx
    tokens = batches()[0]
    program.step(program.local_batch(tokens), loss_fn)  # the first step compiles and builds the schedules
    names = {axis: ctx.group(axis) for axis in (*ctx.group_names, *(("ep", "edp") if ctx.size("ep") > 1 else ()))}
    sequence = lambda: {n: _group(n)._get_sequence_number_for_group() for n in set(names.values())}  # noqa: E731
    before = sequence()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        program.step(program.local_batch(tokens), loss_fn)
    after = sequence()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return {"kinds": _kinds(events), "groups": {n: after[n] - before[n] for n in after}, "names": names,
            "pp": ctx.coord("pp"), "dp": ctx.size("dp"), "compiled": program.compile_options is not None}


def _kinds(events) -> dict[str, list[int]]:
    """{kind: [count, bytes]} of the profiler's collective events."""
    seen = collections.defaultdict(list)  # event name -> [(numel, element bytes)] of the tensor that counts
    where = {"c10d::_allgather_base_": lambda d: d[0], "c10d::allgather_into_tensor_coalesced_": lambda d: d[0][0],
             "c10d::_reduce_scatter_base_": lambda d: d[1], "c10d::reduce_scatter_tensor_coalesced_": lambda d: d[1][0],
             "gloo:all_reduce": lambda d: d[0], "gloo:all_to_all": lambda d: d[0], "gloo:send": lambda d: d[0],
             "gloo:recv": lambda d: d[0]}
    for e in events:
        args = e.get("args", {})
        pick = where.get(e.get("name"))
        if pick is None or "Input Dims" not in args:
            continue
        types = args["Input type"]
        kind = types[0] if isinstance(types[0], str) and types[0] != "TensorList" else None
        seen[e["name"]].append((math.prod(pick(args["Input Dims"])), _TYPE_BYTES[kind or "float"]))
    gathers = seen["c10d::_allgather_base_"] + seen["c10d::allgather_into_tensor_coalesced_"]
    scatters = seen["c10d::_reduce_scatter_base_"] + seen["c10d::reduce_scatter_tensor_coalesced_"]
    # gloo runs a reduce-scatter as an all-reduce of its input: those are not all-reduces of the step
    reduces = collections.Counter(seen["gloo:all_reduce"])
    reduces.subtract(collections.Counter(scatters))
    assert all(v >= 0 for v in reduces.values()), reduces
    out = {"all_gather": gathers, "reduce_scatter": scatters, "all_reduce": list(reduces.elements()),
           "all_to_all": seen["gloo:all_to_all"], "send": seen["gloo:send"], "recv": seen["gloo:recv"]}
    return {kind: [len(v), sum(n * b for n, b in v)] for kind, v in out.items()}


# ---- the parent: what the declarations say -------------------------------------------------------


def _local_shape(param, strategy: LayerStrategy, mesh: Mesh) -> tuple[int, ...]:
    """The parameter's shape after tp (Megatron) and ep (experts) splits, before ZeRO (passes/context.py)."""
    shape = list(param.global_shape)
    if strategy.tp == "megatron" and mesh.tp > 1 and param.tp_role in TP_ROLE_DIM:
        shape[TP_ROLE_DIM[param.tp_role]] //= mesh.tp
    if param.tp_role == "expert" and strategy.ep and mesh.ep > 1:
        shape[0] //= mesh.ep
    return tuple(shape)


def _dp_elements(shapes: list[tuple[int, ...]], n: int, layout: str) -> int:
    if layout == "dim0":  # ZeRO-3 and in-forward gathers: dim 0 padded to a multiple of the group
        return sum(-(-s[0] // n) * n * math.prod(s[1:]) for s in shapes)
    if layout == "flat":  # the optimizer's flat reductions and gathers: flattened, padded
        return sum(-(-math.prod(s) // n) * n for s in shapes)
    return sum(math.prod(s) for s in shapes)


class _Declared:
    """Running totals: {kind: [count, bytes]}, {axis: count}, and the optimizer's buckets."""

    def __init__(self):
        self.kinds = {kind: [0, 0] for kind in mp.KINDS}
        self.axes = collections.Counter()
        self.buckets: dict[tuple[str, str], int] = {}  # (kind, axis) -> bytes

    def add(self, kind: str, axis: str, count: int, nbytes: float, bucketed: bool = False):
        if bucketed:
            self.buckets[kind, axis] = self.buckets.get((kind, axis), 0) + nbytes
            return
        self.kinds[kind][0] += count
        self.kinds[kind][1] += nbytes
        self.axes[axis] += count

    def close(self):
        for (kind, axis), nbytes in self.buckets.items():  # one bucket each: BIG_BUCKET holds the model
            self.add(kind, axis, 1, nbytes)
        return self


def _add_data_parallel(out: _Declared, layer, strategy: LayerStrategy, mesh: Mesh, m: int, compiled: bool):
    params = [p for p in layer.params if not (p.tp_role == "expert" and strategy.ep and mesh.ep > 1)]
    if not params:
        return
    shapes = [_local_shape(p, strategy, mesh) for p in params]
    for c in data_parallel_form(strategy, mesh, m, compiled, layer.kind).collectives:
        assert c.axis != "dp_replicate", "HSDP is tests/test_conformance.py's"
        n = mesh.dp_shard if c.axis == "dp_shard" else mesh.dp
        times = m if c.per_micro_batch else 1
        bucketed = not c.in_graph and c.phase in ("after_backward", "after_update")
        layout = "plain" if c.kind == "all_reduce" else ("flat" if bucketed else "dim0")
        wire = {"weight": strategy.weight_comm, "grad": strategy.grad_comm, "param": "bf16"}[c.payload]
        if bucketed and wire in mp.QUANT_BITS:  # quantized optimizer syncs: one per parameter, not in buckets
            for shape in shapes:
                for kind, nbytes in mp.wire_form(c.kind, wire, _dp_elements([shape], n, layout), n, 4):
                    out.add(kind, c.axis, 1, nbytes)
        elif bucketed:
            out.add(c.kind, c.axis, 1, 4 * _dp_elements(shapes, n, layout), bucketed=True)
        elif c.kind == "all_reduce" and c.axis == "dp":  # in the graph: one per parameter
            out.add(c.kind, c.axis, times * len(shapes), times * 4 * _dp_elements(shapes, n, layout))
        else:  # one per layer (the ZeRO-3 flat gather / reduce-scatter), on the layer's wire
            for kind, nbytes in mp.wire_form(c.kind, wire, _dp_elements(shapes, n, layout), n, 4):
                out.add(kind, c.axis, times, times * nbytes)


def _declared(case: Case, pp_coord: int) -> _Declared:
    graph, plan = _graph(case.model), case.plan()
    mesh, m = plan.mesh, case.micro_batches
    tokens = BATCH // mesh.dp // m * SEQ  # T of one micro-batch on one rank
    factor = MODELS[case.model][1].get("capacity_factor")
    rows = {layer.name: layer.num_experts * expert_capacity(tokens, layer.num_experts, layer.top_k, factor) / tokens
            for layer in graph.layers if layer.kind == "moe"}  # E·C/T of the model's capacity rule
    out = _Declared()
    strategies = [plan.strategy(layer.name) for layer in graph.layers]
    mine = [s.stage % mesh.pp == pp_coord for s in strategies]
    for i, (layer, strategy) in enumerate(zip(graph.layers, strategies)):
        if not mine[i]:
            continue
        _add_data_parallel(out, layer, strategy, mesh, m, case.compiled)
        for c in mp.model_parallel_form(layer, strategy, mesh):
            times = m if c.per_micro_batch else 1
            nbytes = mp.payload_bytes(c, layer, strategy, mesh, tokens, 4, rows.get(layer.name), seq_len=SEQ)
            out.add(c.kind, c.axis, times * c.count, times * nbytes, bucketed=not c.in_graph)
    for i in range(len(strategies) - 1):  # stage boundaries: one value (the residual stream) crosses each
        if strategies[i].stage == strategies[i + 1].stage:
            continue
        for sends, here in ((True, mine[i]), (False, mine[i + 1])):
            for c in mp.stage_boundary_form(sends) if here else ():
                out.add(c.kind, c.axis, m, m * mp.payload_bytes(c, graph.layers[i], strategies[i], mesh, tokens, 4))
    for c in mp.step_scalars(mesh):
        out.add(c.kind, c.axis, 1, 4)
    return out.close()


@pytest.fixture(scope="module")
def issued2():
    return run_gloo_cases({name: functools.partial(_issued, case=case) for name, case in CASES_2.items()}, 2,
                          timeout_s=900)


@pytest.fixture(scope="module")
def issued_user():
    return run_gloo_cases({name: functools.partial(_issued, case=case) for name, case in CASES_USER.items()}, 2,
                          timeout_s=300)


@pytest.fixture(scope="module")
def issued4():
    return run_gloo_cases({name: functools.partial(_issued, case=case) for name, case in CASES_4.items()}, 4,
                          timeout_s=900)


def _check(case: Case, per_rank: list[dict]):
    for r in per_rank:
        assert r["compiled"] == case.compiled
        declared = _declared(case, r["pp"])
        assert r["kinds"] == declared.kinds
        by_group = collections.Counter()
        for axis, count in declared.axes.items():
            by_group[r["names"][axis]] += count
        assert {g: n for g, n in r["groups"].items() if n} == dict(+by_group)


@pytest.mark.parametrize("name", list(CASES_2))
@pytest.mark.slow
def test_mixed_plans_issue_the_declared_collectives_world2(issued2, name):
    _check(CASES_2[name], issued2[name])


@pytest.mark.parametrize("name", list(CASES_USER))
@pytest.mark.slow
def test_user_blocks_issue_the_declared_collectives(issued_user, name):
    _check(CASES_USER[name], issued_user[name])


@pytest.mark.parametrize("name", list(CASES_4))
@pytest.mark.slow
def test_mixed_plans_issue_the_declared_collectives_world4(issued4, name):
    _check(CASES_4[name], issued4[name])


def test_quantized_rows_match_the_kernels_layout():
    """``quantized_row_bytes`` is the row the runtime moves: the block ``block_for`` picks, the layout's bytes."""
    from autoshard.kernels.layout import QuantLayout
    from autoshard.kernels.quantized_collectives import block_for

    for wire in ("int8", "fp8", "int4"):
        for shard in (1, 63, 64, 65, 100, 1000, 4096, 8320, 12288, 100_000):
            block = block_for(shard, wire)
            assert mp.quantized_row_bytes(shard, wire) == QuantLayout(wire, block, shard, 1).chunk_bytes


def test_split_blocks_declare_and_price_one_side():
    """NanoPolicy's column-only layers (qkv, fc) declare f, its row-only ones (proj, out) g; the cost model
    prices only those: one tp direction each, half a whole attention's TP time (tier 1, no ranks)."""
    from autoshard.search.layer_terms import critical_terms, sharding
    from autoshard.search.synthetic import synthetic_cluster

    graph, mesh, schedule = _graph("nano"), Mesh(tp=2), Schedule(micro_batch=4, num_micro_batches=1)
    sides = {"qkv": "backward", "fc": "backward", "proj": "forward", "out": "forward"}
    for name, phase in sides.items():
        layer = graph.layer(f"blocks.0.{name}")
        for sp, kinds in ((False, {"all_reduce"}), (True, {"all_gather", "reduce_scatter"})):
            strategy = LayerStrategy(layer=layer.name, tp="megatron", sp=sp)
            form = [c for c in mp.tensor_parallel_form(layer, strategy, mesh) if c.payload == "hidden"]
            assert {c.kind for c in form} == kinds and len(form) == (2 if sp else 1)
            if not sp:
                assert form[0].phase == phase
                terms = critical_terms(layer, strategy, sharding(layer, strategy, mesh, schedule, SEQ), mesh,
                                       synthetic_cluster("h100-sxm", 1))
                assert (terms["tp_fwd_s"] > 0, terms["tp_bwd_s"] > 0) == (phase == "forward", phase == "backward")
