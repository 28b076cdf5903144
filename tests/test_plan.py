"""Plan files: JSON round trip, byte determinism, atomic save, strict validation
with JSON paths, fingerprint checks, human forms, and a fuzzed loader."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from autoshard.cluster import Cluster
from autoshard.errors import PlanError
from autoshard.graph import LayerInfo, ModelGraph, ParamInfo
from autoshard.plan import (
    Fingerprints,
    LayerStrategy,
    Mesh,
    Plan,
    PlanFieldError,
    Predictions,
    Schedule,
    SolverStats,
)
from autoshard.plan_format import fold_layers

GIB = 2**30


def _graph(hidden: int = 8, blocks: int = 2, name: str = "toy") -> ModelGraph:
    def layer(lname, kind, index, block, params):
        return LayerInfo(lname, kind, index, block, kind, tuple(ParamInfo(n, s, "float32") for n, s in params))

    layers = [layer("embed", "embedding", 0, None, [("embed.weight", (32, hidden))])]
    for b in range(blocks):
        layers.append(layer(f"blocks.{b}.attn", "attention", len(layers), b, [(f"blocks.{b}.attn.qkv", (3 * hidden, hidden))]))
        layers.append(layer(f"blocks.{b}.mlp", "mlp", len(layers), b, [(f"blocks.{b}.mlp.up", (4 * hidden, hidden))]))
    layers.append(layer("head", "head", len(layers), None, [("head.weight", (32, hidden))]))
    edges = tuple((a.name, b.name) for a, b in zip(layers, layers[1:]))
    return ModelGraph(name, tuple(layers), edges, "float32", hidden, blocks, 32)


def _plan(graph: ModelGraph | None = None, cluster: Cluster | None = None, pp: int = 2) -> Plan:
    graph = graph or _graph()
    names = [layer.name for layer in graph.layers]
    layers = tuple(
        LayerStrategy(
            name,
            state="zero3",
            tp="megatron" if "attn" in name or "mlp" in name else "none",
            sp=True,
            recompute="selective" if "blocks" in name else "none",
            weight_comm="int8",
            stage=0 if i < len(names) // 2 else pp - 1,
        )
        for i, name in enumerate(names)
    )
    return Plan(
        model_name=graph.model_name,
        mesh=Mesh(dp_shard=2, tp=2, pp=pp),
        layers=layers,
        schedule=Schedule(micro_batch=2, num_micro_batches=4),
        predictions=Predictions(
            step_time_s=1.25, compute_s=0.9, exposed_comm_s=0.2, bubble_s=0.1, optimizer_s=0.05,
            peak_memory_bytes=61 * GIB, memory_by_stage=(61 * GIB, 50 * GIB),
            memory_breakdown={"params": 10 * GIB, "activations": 30 * GIB}, tokens_per_s=12345.0, mfu=0.41,
        ),
        solver=SolverStats("OPTIMAL", 1.25, 1.2, 0.04, 3.5, 40, 12),
        fingerprints=Fingerprints.of(graph, cluster, cost_model="1"),
        global_batch=16,
        seq_len=128,
    )


@pytest.fixture
def cluster() -> Cluster:
    return Cluster.load("h100-sxm:1x8")


# ------------------------------------------------------------------ round trip
def test_dict_and_file_round_trip(tmp_path, cluster):
    plan = _plan(_graph(), cluster)
    assert Plan.from_dict(plan.to_dict()) == plan
    data = plan.to_dict()
    assert (data["format"], data["version"]) == ("autoshard.plan", 1)
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path) == plan
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would create it


def test_same_plan_gives_identical_bytes(tmp_path, cluster):
    a, b = _plan(_graph(), cluster), _plan(_graph(), cluster)
    assert a is not b
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    Plan.load(tmp_path / "a.json").save(tmp_path / "c.json")
    raw = (tmp_path / "a.json").read_bytes()
    assert raw == (tmp_path / "b.json").read_bytes() == (tmp_path / "c.json").read_bytes()
    assert raw.endswith(b"\n") and b'"format": "autoshard.plan"' in raw


def test_save_is_atomic(tmp_path, monkeypatch):
    plan = _plan()
    path = plan.save(tmp_path / "plan.json")
    before = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    changed = dataclasses.replace(plan, global_batch=32)
    with pytest.raises(PlanError, match="disk full; the file is unchanged"):  # one line, exit 2 in the CLI
        changed.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # temporary file removed


def test_construction_normalises_lists_and_numbers():
    plan = Plan("m", Mesh(dp_shard=2), [LayerStrategy("a")])  # list → tuple
    assert isinstance(plan.layers, tuple)
    preds = Predictions(step_time_s=1, memory_by_stage=[3, 4])
    assert preds.step_time_s == 1.0 and isinstance(preds.step_time_s, float)
    assert preds.memory_by_stage == (3, 4)


# ----------------------------------------------------------------- validation
def _corrupt(data: dict, path: tuple, value=..., delete: bool = False) -> dict:
    data = copy.deepcopy(data)
    target = data
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


BAD_FIELDS = [
    (("layers", 3, "state"), "zero4", "layers[3].state: 'zero4' not in ('replicate', 'zero1', 'zero2', 'zero3', 'offload')"),
    (("layers", 1, "tp"), "column", "layers[1].tp: 'column' not in ('none', 'megatron')"),
    (("layers", 1, "sp"), 1, "layers[1].sp: expected bool, got 1"),
    (("layers", 2, "recompute"), None, "layers[2].recompute: expected str, got null None"),
    (("layers", 2, "grad_comm"), "int2", "layers[2].grad_comm: 'int2' not in"),
    (("layers", 2, "weight_comm"), "fp4", "layers[2].weight_comm: 'fp4' not in"),
    (("layers", 0, "stage"), -1, "layers[0].stage: -1 must be >= 0"),
    (("layers", 4, "stage"), 0, "layers[4].stage: 0 < 1 of layers[3]: stages must be non-decreasing"),
    (("layers", 5, "stage"), 2, "layers[5].stage: 2 must be < mesh.pp*schedule.virtual_stages = 2*1"),
    (("layers", 1, "layer"), "embed", "layers[1].layer: 'embed' repeats layers[0]"),
    (("layers", 1, "recompte"), "full", "layers[1]: unknown field 'recompte'"),
    (("mesh", "tp"), 0, "mesh.tp: 0 must be >= 1"),
    (("mesh", "tp"), "2", "mesh.tp: expected int, got '2'"),
    (("mesh", "dp_shard"), 2.5, "mesh.dp_shard: expected int, got 2.5"),
    (("mesh", "ep"), 3, "mesh.ep: 3 must divide dp_replicate*dp_shard = 1*2 = 2"),
    (("schedule", "name"), "zb", "schedule.name: 'zb' not in ('gpipe', '1f1b', 'interleaved_1f1b')"),
    (("schedule", "virtual_stages"), 2, "schedule.virtual_stages: 2 > 1 needs name='interleaved_1f1b'"),
    (("predictions", "step_time_s"), -1.0, "predictions.step_time_s: -1.0 must be >= 0"),
    (("predictions", "memory_by_stage"), [1, "x"], "predictions.memory_by_stage[1]: expected int"),
    (("predictions", "memory_breakdown"), {"params": 1.5}, "predictions.memory_breakdown.params: expected int"),
    (("fingerprints", "layers", 0, "params", 0, "shape"), [32, "8"], "fingerprints.layers[0].params[0].shape[1]"),
    (("layers",), {"a": 1}, "layers: expected an array, got object"),
    (("precision",), "fp16", "precision: 'fp16' not in ('bf16', 'fp32')"),
    (("global_batch",), True, "global_batch: expected int, got bool True"),
    (("version",), 2, "plan version 2 is not supported; this autoshard reads versions (1,)"),
    (("version",), "1", "plan version '1' is not supported"),
    (("format",), "other", "format: 'other' is not 'autoshard.plan'"),
]


@pytest.mark.parametrize("path, value, expected", BAD_FIELDS, ids=[".".join(map(str, p)) for p, _, _ in BAD_FIELDS])
def test_bad_field_names_its_json_path_and_file(tmp_path, path, value, expected):
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(_corrupt(_plan().to_dict(), path, value)))
    with pytest.raises(PlanError) as info:
        Plan.load(file)
    message = str(info.value)
    assert message.startswith(f"{file}: ")
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("path, expected", [
    (("layers", 2, "layer"), "layers[2].layer: missing (required field)"),
    (("mesh",), "mesh: missing (required field)"),
    (("model_name",), "model_name: missing (required field)"),
])
def test_missing_required_field(path, expected):
    with pytest.raises(PlanError, match=re.escape(expected)):
        Plan.from_dict(_corrupt(_plan().to_dict(), path, delete=True))


def test_fields_with_defaults_are_still_required_in_a_file():
    # A file holds every field (save writes them all): a missing one is damage, not a request for the default.
    minimal = {"format": "autoshard.plan", "version": 1, "model_name": "m", "mesh": {"dp_shard": 2},
               "layers": [{"layer": "a"}, {"layer": "b", "state": "zero3"}]}
    with pytest.raises(PlanError, match=re.escape("mesh.dp_replicate: missing (required field)")):
        Plan.from_dict(minimal)
    with pytest.raises(PlanError, match=re.escape("global_batch: missing (required field)")):
        Plan.from_dict(_corrupt(_plan().to_dict(), ("global_batch",), delete=True))
    # except the fields added after the first plans were written (Predictions.OPTIONAL_ON_LOAD)
    older = _corrupt(_corrupt(_plan().to_dict(), ("predictions", "caveats"), delete=True),
                     ("predictions", "build_peak_bytes"), delete=True)
    assert Plan.from_dict(older).predictions.caveats == ()


def test_truncated_file_names_the_file(tmp_path):
    raw = _plan().to_json().encode()
    file = tmp_path / "cut.json"
    file.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(PlanError, match="cut.json: not a valid JSON plan .*truncated"):
        Plan.load(file)


def test_missing_file_and_non_object(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan file .*nope.json"):
        Plan.load(tmp_path / "nope.json")
    with pytest.raises(PlanError, match="a plan is a JSON object, got list"):
        Plan.from_json("[1, 2]")


def test_construction_checks_fields_too():
    with pytest.raises(PlanFieldError, match="state: 'zero4' not in"):
        LayerStrategy("a", state="zero4")
    with pytest.raises(PlanError, match="mesh.ep: 3 must divide"):
        Plan.from_dict(_corrupt(_plan().to_dict(), ("mesh", "ep"), 3))
    with pytest.raises(PlanFieldError, match="not finite"):
        Predictions(step_time_s=float("nan"))


# --------------------------------------------------------------- fingerprints
def test_compatible_with_its_own_graph_and_cluster(cluster, tmp_path):
    graph = _graph()
    plan = _plan(graph, cluster)
    plan.check_compatible(graph=graph, cluster=cluster)
    assert Plan.load(plan.save(tmp_path / "p.json"), graph=graph, cluster=cluster) == plan


def test_incompatible_model_names_first_difference(cluster):
    plan = _plan(_graph(hidden=8), cluster)
    with pytest.raises(PlanError, match=r"layer 'embed': plan has parameter 'embed.weight' \[32, 8\] float32, "
                                        r"model has 'embed.weight' \[32, 16\]"):
        plan.check_compatible(graph=_graph(hidden=16))
    with pytest.raises(PlanError, match="layer 5: plan has 'head', model has 'blocks.2.attn'"):
        plan.check_compatible(graph=_graph(blocks=3))
    with pytest.raises(PlanError, match="model name or dtype differs"):
        plan.check_compatible(graph=_graph(name="other"))


def test_plan_without_fingerprint_still_checks_layer_names():
    plan = dataclasses.replace(_plan(), fingerprints=Fingerprints())
    plan.check_compatible(graph=_graph())
    with pytest.raises(PlanError, match=r"layers\[5\] is 'head' but the model's layer 5 is 'blocks.2.attn'"):
        plan.check_compatible(graph=_graph(blocks=3))
    shorter = dataclasses.replace(plan, layers=plan.layers[:-1])
    with pytest.raises(PlanError, match="plan has 5 layers, model has 6"):
        shorter.check_compatible(graph=_graph())


def test_incompatible_cluster_names_the_field(cluster):
    plan = _plan(_graph(), cluster)
    other = Cluster.load("h100-sxm:2x8")
    with pytest.raises(PlanError, match="cluster field 'nodes': plan has 1, cluster has 2"):
        plan.check_compatible(cluster=other)
    smaller = Cluster.load("h100-sxm:1x4")
    unrecorded = dataclasses.replace(plan, fingerprints=Fingerprints())
    with pytest.raises(PlanError, match=r"mesh world size 8 .* != cluster world size 4"):
        unrecorded.check_compatible(cluster=smaller)


# ---------------------------------------------------------------- human forms
@pytest.mark.parametrize("kwargs, notation", [
    ({}, "DDP"),
    ({"state": "zero3", "tp": "megatron", "sp": True, "recompute": "selective", "weight_comm": "int8"},
     "Z3·TP·SP·R(sel)·qW8"),
    ({"state": "offload", "ep": True, "recompute": "full", "grad_comm": "int4"}, "Off·EP·R(full)·qG4"),
    ({"state": "zero1", "weight_comm": "fp8", "grad_comm": "fp32"}, "Z1·qWf8·G32"),
])
def test_notation(kwargs, notation):
    strategy = LayerStrategy("x", **kwargs)
    assert strategy.notation == notation == str(strategy)


def test_str_is_a_folded_table_and_repr_is_full():
    plan = _plan(_graph(blocks=4), pp=1)
    text = str(plan)
    assert "mesh dp_replicate=1 dp_shard=2 tp=2 pp=1 ep=1 cp=1 (world 4) | no pipeline: 4 micro-batches" in text
    assert "predicted step 1.25 s" in text and "peak 61.00 GiB" in text
    assert "solver OPTIMAL" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[7:]}
    assert set(rows) == {"embed", "blocks.0-3.attn", "blocks.0-3.mlp", "head"}
    assert rows["blocks.0-3.attn"][1:4] == ["Z3·TP·SP·R(sel)·qW8", "zero3", "megatron"]
    assert "LayerStrategy(layer='blocks.3.mlp', state='zero3'" in repr(plan)


def test_folding_breaks_at_stage_boundary_and_differences():
    def s(name, **kw):
        return LayerStrategy(name, **kw)

    layers = (s("embed"), s("blocks.0.attn"), s("blocks.0.mlp"), s("blocks.1.attn"), s("blocks.1.mlp"),
              s("blocks.2.attn", stage=1), s("blocks.2.mlp", stage=1), s("blocks.3.attn", stage=1),
              s("blocks.3.mlp", stage=1, recompute="full"), s("head", stage=1))
    names = [name for name, _ in fold_layers(layers)]
    assert names == ["embed", "blocks.0-1.attn", "blocks.0-1.mlp", "blocks.2.attn", "blocks.2.mlp",
                     "blocks.3.attn", "blocks.3.mlp", "head"]


def test_rich_renders_the_same_rows():
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(_plan(_graph(blocks=4), pp=1).to_rich())
    out = console.export_text()
    assert "blocks.0-3.attn" in out and "Z3·TP·SP·R(sel)·qW8" in out and "tokens/s" in out
    console = Console(record=True, width=200)
    console.print(_plan(_graph(blocks=4), pp=1).to_rich(fold=False))
    assert "blocks.2.mlp" in console.export_text()


# ----------------------------------------------------------------------- fuzz
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


_BASE = _plan(_graph(blocks=1), pp=2).to_dict()
_BASE_PATHS = [p for p in _paths(_BASE) if p]


def _load_or_plan_error(raw: bytes) -> None:
    try:
        plan = Plan.from_json(raw, source="fuzz.json")
    except PlanError as err:
        assert str(err).startswith("fuzz.json: ")
    else:
        assert Plan.from_json(plan.to_json()) == plan  # anything accepted round-trips


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutations_give_plan_or_plan_error(data):
    doc = copy.deepcopy(_BASE)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = data.draw(st.sampled_from(paths))
        if data.draw(st.booleans()):
            doc = _corrupt(doc, path, delete=True)
        else:
            doc = _corrupt(doc, path, data.draw(_JSON))
    _load_or_plan_error(json.dumps(doc).encode())


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(0, 10**6), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3))
def test_fuzz_truncated_and_flipped_bytes(cut, flips):
    raw = bytearray(json.dumps(_BASE).encode())
    for position, byte in flips:
        raw[position % len(raw)] = byte
    _load_or_plan_error(bytes(raw[: cut % (len(raw) + 1)]))
