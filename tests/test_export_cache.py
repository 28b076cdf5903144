"""``runtime/export_cache.py``: a model structure is exported once per process, and a hit is the same graph;
with ``AUTOSHARD_EXPORT_CACHE=disk`` another process loads the saved program (note "on disk")."""

from __future__ import annotations

import pytest
import torch

from _harness import fake_world, run_gloo
from _runtime_cases import graph_of
from autoshard.models import build
from autoshard.plan import Mesh
from autoshard.runtime import export_cache
from autoshard.runtime.mesh import build_rank_context
from autoshard.runtime.program import export_model


def _code(spec: str, dtype=torch.float32, model=None) -> str:
    ctx, _ = build_rank_context(Mesh(dp_shard=2), compute_dtype=dtype)
    gm = export_model(model if model is not None else build(spec), graph_of(spec), ctx)
    return gm.code


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_second_export_of_a_structure_is_a_copy_of_the_first(monkeypatch):
    monkeypatch.setenv(export_cache.ENV, "1")  # the default: this process only
    export_cache.clear()
    with fake_world(2):
        first = _code("llama:tiny")
        assert (export_cache.stats.misses, export_cache.stats.hits) == (1, 0)
        again = _code("llama:tiny")  # a fresh model of the same structure: other weights, same graph
        assert (export_cache.stats.misses, export_cache.stats.hits) == (1, 1)
        assert again == first
        # another dtype, another family: exported afresh, and the graph differs
        half = _code("llama:tiny", torch.bfloat16)
        gpt = _code("gpt:tiny")
        assert export_cache.stats.misses == 3 and half != first and gpt != first
        # off by environment: exported afresh, the same graph as the cached one
        monkeypatch.setenv(export_cache.ENV, "0")
        assert _code("llama:tiny") == first
        assert export_cache.stats.uncached == 1 and export_cache.stats.hits == 1


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_a_changed_attribute_or_unpicklable_model_is_not_a_hit(monkeypatch):
    monkeypatch.setenv(export_cache.ENV, "1")
    export_cache.clear()
    with fake_world(2):
        _code("llama:tiny")
        model = build("llama:tiny")
        model.blocks[0].attn.num_heads_note = 3  # any attribute of any module is part of the key
        _code("llama:tiny", model=model)
        assert (export_cache.stats.misses, export_cache.stats.hits) == (2, 0)
        model.blocks[0].mlp.register_forward_hook(lambda *a: None)  # a lambda does not pickle
        _code("llama:tiny", model=model)
        assert export_cache.stats.uncached == 1
    export_cache.clear()


def _kept_meta(gm) -> dict:
    """Per node, the meta a fresh export sets and the passes read (``val`` as its repr, ``tensor_meta``'s shape
    and dtype, the module stack), and the graph's inline constraints (``export_cache`` note "on disk": what
    differs after a reload is ``tensor_meta``'s ``requires_grad`` and symbolic strides)."""
    def kept(node):
        meta = {key: repr(node.meta[key]) for key in ("val", "nn_module_stack") if node.meta.get(key) is not None}
        if "tensor_meta" in node.meta:
            meta["tensor_meta"] = repr((node.meta["tensor_meta"].shape, node.meta["tensor_meta"].dtype))
        return meta

    nodes = {node.name: kept(node) for node in gm.graph.nodes}
    return {"nodes": nodes, "inline_constraints": repr(gm.meta["inline_constraints"])}


def _model_and_graph(name: str):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
        import _hf_tp_cases
        from autoshard.models.hf import actor_critic

        return actor_critic(_hf_tp_cases.config_of(name[3:]), dtype=torch.float32), _hf_tp_cases.graph_of(name[3:])
    return build(name), graph_of(name)


@pytest.mark.slow  # over ~3 s: not in make test-fast
@pytest.mark.parametrize("name", ["llama:tiny", "moe:tiny", "hf-mixtral"])
def test_a_program_saved_on_disk_loads_as_the_export_it_was(monkeypatch, tmp_path, name):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(export_cache.ENV, "disk")
    export_cache.clear()
    model, graph = _model_and_graph(name)
    with fake_world(2):
        ctx = build_rank_context(Mesh(dp_shard=2))[0]
        first = export_model(model, graph, ctx)
        assert (export_cache.stats.misses, export_cache.stats.loaded) == (1, 0)
        (entry,) = (tmp_path / "export").glob("*.pt2")
        export_cache.clear()  # as a new process: only the disk knows the program
        again = export_model(model, graph, ctx)
        assert (export_cache.stats.misses, export_cache.stats.loaded) == (0, 1)
        fresh, loaded = _kept_meta(first), _kept_meta(again)
        assert again.code == first.code and loaded["inline_constraints"] == fresh["inline_constraints"]
        differ = [(node, key, meta.get(key), loaded["nodes"][node].get(key)) for node, meta in fresh["nodes"].items()
                  for key in set(meta) | set(loaded["nodes"][node]) if meta.get(key) != loaded["nodes"][node].get(key)]
        assert not differ, differ[:3]
        assert sum("tensor_meta" in meta for meta in loaded["nodes"].values()) > 50
        if name != "llama:tiny":
            return
        entry.write_bytes(b"not a program")  # damaged: exported again, and the entry rewritten
        export_cache.clear()
        assert export_model(model, graph, ctx).code == first.code
        assert (export_cache.stats.misses, export_cache.stats.loaded) == (1, 0)
        assert entry.read_bytes() != b"not a program"


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_tied_parameters_are_never_saved(monkeypatch, tmp_path):
    """A reloaded program would hold two tensors for gpt:tiny's tied embedding and head: exported every time."""
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(export_cache.ENV, "disk")
    export_cache.clear()
    with fake_world(2):
        export_model(build("gpt:tiny"), graph_of("gpt:tiny"), build_rank_context(Mesh(dp_shard=2))[0])
    assert export_cache.stats.misses == 1 and not (tmp_path / "export").exists()
    export_cache.clear()


def _first_build_stats(rank, world_size):
    from _runtime_cases import make_plan
    from autoshard.runtime import build_program
    from autoshard.train import TrainSpec

    primed = (len(export_cache._CACHE), export_cache.stats.misses + export_cache.stats.loaded)
    before = (export_cache.stats.hits, export_cache.stats.misses)
    plan = make_plan("llama:tiny", Mesh(dp_shard=2), lambda _layer: {"state": "zero3"})
    for precision in ("fp32", "bf16"):
        build_program(build("llama:tiny"), graph_of("llama:tiny"), plan,
                      TrainSpec(global_batch=8, seq_len=8, precision=precision))
    return primed, before, (export_cache.stats.hits, export_cache.stats.misses)


@pytest.mark.slow
def test_gloo_ranks_find_the_reference_models_exported_by_the_server():
    """``tests/_export_warm.py`` exports the reference models in the forkserver and the cache keeps every one
    (none evicted): a rank's first builds of llama:tiny in fp32 and bf16 are cache hits."""
    for (kept, exported), before, after in run_gloo(_first_build_stats, 2):
        assert kept == exported > 0
        assert before[1] == after[1] and after[0] == before[0] + 2
