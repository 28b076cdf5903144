"""Async all-gather ops (kernels/async_collectives.py) and the ``schedule_overlap`` pass.

One spawned gloo job (world 2) runs every multi-process case: the start/wait
ops against the blocking ``autoshard::all_gather`` (values and gradients,
float64), the error on a second wait, and ZeRO-3 training of tiny GPT and
Llama policies with prefetch 0 (blocking gathers), 1 and 2: losses and
parameters after 3 SGD steps must agree (rtol 1e-6), with no collective left
pending after any step. Graph structure (start before the previous layer's
compute, wait at first use, one wait per start, quantized layers untouched)
and ``torch.export`` of the rewritten graph run in one process under a fake
process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
from torch.export import Dim
from torch.utils._python_dispatch import TorchDispatchMode

from _harness import fake_world, local_ranks, run_gloo_cases
from _runtime_cases import BATCH, MICRO, SEQ, batches, graph_of, loss_fn, make_plan, reassemble
from autoshard.errors import AutoshardError
from autoshard.models import build
from autoshard.passes._zero3 import Zero3Gather
from autoshard.passes.schedule_overlap import LIGHT_FRACTION, GatherStart, GatherWait, prefetch_anchors
from autoshard.plan import Mesh, Plan
from autoshard.kernels import async_collectives as A
from autoshard.runtime import build_program
from autoshard.kernels import collectives as C
from autoshard.runtime.optimizer import OptimizerConfig
from autoshard.train import TrainSpec

GPT, LLAMA = "gpt:tiny", "llama:tiny"
OPT = OptimizerConfig(name="sgd", lr=0.5, max_grad_norm=1.0)
TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32")


def _plan(spec: str, prefetch: int, choose=lambda _layer: {"state": "zero3"}) -> Plan:
    plan = make_plan(spec, Mesh(dp_shard=2), choose)
    return dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, prefetch=prefetch))


# --------------------------------------------------------------------------- gloo cases


def _op_case(rank, world_size):
    """start + wait equal the blocking all-gather (values, gradients with grad_op avg); one pending at most."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(world_size * 6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
    ref = C.all_gather(x, 0, None, "avg")
    (ref * w).sum().backward()
    ref_grad, x.grad = x.grad.clone(), None
    pending = A.all_gather_start(x, None, "avg")
    in_flight = A.pending_count()
    left, right = A.all_gather_wait(pending, world_size, [10, 8])  # (n, 10), (n, 8) of the (n, 18) rows
    out = torch.cat([left, right], 1).reshape(world_size * 6, 3)
    (out * w).sum().backward()
    return {"equal": torch.equal(out.detach(), ref.detach()), "grad": torch.equal(x.grad, ref_grad),
            "in_flight": in_flight, "after": A.pending_count(), "shapes": (tuple(left.shape), tuple(right.shape))}


def _double_wait_case(rank, world_size):
    pending = A.all_gather_start(torch.ones(4), None)
    A.all_gather_wait(pending, world_size, [4])
    try:
        A.all_gather_wait(pending, world_size, [4])
    except AutoshardError as exc:
        return str(exc)
    return None


class _Passthrough(TorchDispatchMode):
    """Any dispatch mode turns the eager fast paths off (op-by-op ``autoshard::`` dispatch instead)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _train_case(rank, world_size, spec, plan, dispatch=False):
    program = build_program(build(spec), graph_of(spec), plan, TRAIN, optimizer=OPT)
    losses, pending = [], []
    for toks in batches():
        with _Passthrough() if dispatch else contextlib.nullcontext():
            losses.append(program.step(program.local_batch(toks), loss_fn).loss)
        pending.append(A.pending_count())
    starts = sum(isinstance(m, GatherStart) for m in program.gm.modules())
    regather = program.regather
    return {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
            "coords": program.ctx.coords, "pending": pending, "starts": starts,
            "regathers": regather.regathers, "prefetches": regather.prefetches, "hits": regather.prefetch_hits,
            "async_reduce_scatters": regather.grad_sink.launched, "sink_left": len(regather.grad_sink)}


def _mixed(layer):
    return {"state": "zero3" if layer.endswith("attn") or layer == "head" else "replicate"}


TRAIN_CASES = {
    "gpt_p0": (GPT, 0), "gpt_p1": (GPT, 1), "gpt_p2": (GPT, 2),
    "gpt_p0_dispatch": (GPT, 0), "gpt_p1_dispatch": (GPT, 1),
    "llama_p0": (LLAMA, 0), "llama_p1": (LLAMA, 1),
    "mixed_p0": (LLAMA, 0, _mixed), "mixed_p1": (LLAMA, 1, _mixed),
}


@pytest.fixture(scope="module")
def results():
    cases = {"op": _op_case, "double_wait": _double_wait_case}
    for name, (spec, prefetch, *choose) in TRAIN_CASES.items():
        cases[name] = functools.partial(_train_case, spec=spec, plan=_plan(spec, prefetch, *choose),
                                        dispatch=name.endswith("_dispatch"))
    return run_gloo_cases(cases, 2, timeout_s=400)


@pytest.mark.slow
def test_start_wait_equal_blocking_gather(results):
    for r in results["op"]:
        assert r["equal"] and r["grad"]
        assert (r["in_flight"], r["after"]) == (1, 0)
        assert r["shapes"] == ((2, 10), (2, 8))


@pytest.mark.slow
def test_second_wait_raises(results):
    for message in results["double_wait"]:
        assert message is not None and "no pending collective" in message


@pytest.mark.parametrize("base,other", [("gpt_p0", "gpt_p1"), ("gpt_p0", "gpt_p2"), ("llama_p0", "llama_p1"),
                                        ("mixed_p0", "mixed_p1")])
@pytest.mark.slow
def test_overlap_numerics_equal_blocking(results, base, other):
    ref, new = results[base], results[other]
    for a, b in zip(ref, new):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-6, atol=0)
    full_ref, full_new = reassemble(ref, Mesh(dp_shard=2)), reassemble(new, Mesh(dp_shard=2))
    for fqn, value in full_ref.items():
        torch.testing.assert_close(full_new[fqn], value, rtol=1e-6, atol=0, msg=lambda m: f"{fqn}: {m}")


@pytest.mark.parametrize("name", ["gpt_p0", "gpt_p1"])
@pytest.mark.slow
def test_fused_eager_gathers_equal_op_by_op_dispatch(results, name):
    """passes/_zero3.py note "fused eager gather": one autograd node per layer gives bit-identical training."""
    for fused, ops in zip(results[name], results[name + "_dispatch"]):
        assert fused["losses"] == ops["losses"]
        for fqn, value in fused["shards"].items():
            assert torch.equal(value, ops["shards"][fqn]), fqn


@pytest.mark.slow
def test_backward_reduce_scatters_leave_the_compute_path(results):
    """prefetch > 0, eager: every gather's reduce-scatter goes through the GradSink (passes/_zero3.py note);
    prefetch 0 and traced/intercepted execution keep the blocking op; nothing is left undrained."""
    for name, (_spec, prefetch, *_rest) in TRAIN_CASES.items():
        for r in results[name]:
            assert r["sink_left"] == 0, name
            if prefetch > 0 and not name.endswith("_dispatch"):
                assert r["async_reduce_scatters"] > 0, name
            else:
                assert r["async_reduce_scatters"] == 0, name


@pytest.mark.slow
def test_every_start_waited_and_used(results):
    for name in TRAIN_CASES:
        for r in results[name]:
            assert r["pending"] == [0, 0, 0], name
            assert (r["starts"] > 0) == (TRAIN_CASES[name][1] > 0), name


@pytest.mark.slow
def test_backward_regathers_prefetched_one_layer_ahead(results):
    """prefetch > 0: re-gathers in backward mostly come from a gather started one layer ahead (recompute.py note).

    Backward does not always unpack layers in exact reverse forward order (the
    value head and the LM head both read the final norm; GPT's head reuses the
    embedding), so a prefetch can miss: at most one per backward here.
    """
    for name in TRAIN_CASES:
        for r in results[name]:
            if TRAIN_CASES[name][1] == 0:
                assert r["prefetches"] == 0, name
            else:  # 3 steps × (re-gathers − 1) when every layer's saved weights are unpacked in reverse order
                backwards = len(r["losses"]) * MICRO  # one per micro-batch; its first re-gather is never prefetched
                assert r["hits"] >= 0.8 * (r["regathers"] - backwards), (name, r["regathers"], r["hits"])
                assert r["prefetches"] - r["hits"] <= backwards, (name, r["prefetches"], r["hits"])  # ≤ 1 wasted each


# --------------------------------------------------------------------------- graph structure (one process)


def _program(spec: str, prefetch: int, choose=lambda _layer: {"state": "zero3"}):
    return build_program(build(spec), graph_of(spec), _plan(spec, prefetch, choose), TRAIN)


def _layer_compute(gm, layer: str) -> list[int]:
    """Graph indices of the call_function nodes of ``layer`` (from nn_module_stack) that are not getitems."""
    out = []
    for i, node in enumerate(gm.graph.nodes):
        stack = [path for path, _t in (node.meta.get("nn_module_stack") or {}).values()]
        if node.op == "call_function" and node.target.__name__ != "getitem" and stack and (
                stack[-1] == layer or stack[-1].startswith(layer + ".")):
            out.append(i)
    return out


def test_start_issued_before_previous_layer_compute_wait_at_first_use():
    with fake_world(2, 0):
        gm = _program(LLAMA, 1).gm
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waits = [n for n in nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), GatherWait)]
    assert len(waits) == len(graph_of(LLAMA).layers)

    def first_use(wait):  # the first node reading one of the layer's gathered parameters
        return min(index[u] for item in wait.users for u in item.users)

    starts = [wait.args[0] for wait in waits]
    assert all(isinstance(gm.get_submodule(s.target), GatherStart) for s in starts)
    assert [index[s] for s in starts] == sorted(index[s] for s in starts)  # issued in wait order
    sizes = [sum(gm.get_submodule(w.target).gather.spec.flat_sizes()) for w in waits]
    heavy = [size >= LIGHT_FRACTION * max(sizes) for size in sizes]
    assert 0 < sum(heavy) < len(waits)  # llama: heavy attn/mlp, light norms
    by_name = {w.name: k for k, w in enumerate(waits)}
    for k, (wait, start) in enumerate(zip(waits, starts)):
        record = start.meta["autoshard"]
        assert record["pass"] == "schedule_overlap" and "prefetch" in record["why"]
        if record["issued_after"] is None:  # only before the first heavy layer has computed
            assert index[start] < index[waits[0]] and not any(heavy[:k])
            continue
        j = by_name[record["issued_after"]]
        assert j < k and sum(heavy[j:k]) >= 1 and sum(heavy[j + 1:k]) == 0, (k, j)  # the latest anchor with 1 heavy
        # issued after the anchor's wait, before that heavy layer's weight-using compute
        assert index[waits[j]] < index[start] < first_use(waits[j]), record
    for wait in waits:  # the wait sits right before the first use: only getitems, get_attrs and a start between
        between = nodes[index[wait] + 1 : first_use(wait)]
        assert all(n in wait.users or n.op == "get_attr"
                   or (n.op == "call_module" and isinstance(gm.get_submodule(n.target), GatherStart)) for n in between)
        assert len(wait.args[0].users) == 1  # one wait per start
        assert wait.meta["autoshard"]["earlier"]["pass"] == "insert_collectives"


def test_prefetch_anchors_skip_light_layers():
    # embed, norm, attn, norm, mlp (norms light): each heavy gather issued after the previous heavy layer's wait
    sizes = [1000, 10, 400, 10, 800]
    assert prefetch_anchors(sizes, 1) == [None, 0, 0, 2, 2]
    assert prefetch_anchors(sizes, 2) == [None, None, None, 0, 0]
    assert prefetch_anchors([5, 5, 5, 5], 1) == [None, 0, 1, 2]  # all heavy: j = k − p
    assert prefetch_anchors([5, 5, 5, 5], 2) == [None, None, 0, 1]


@pytest.mark.slow
def test_prefetch_zero_and_quantized_layers_keep_blocking_gathers():
    quantized = lambda layer: {"state": "zero3", "weight_comm": "int8" if layer == "blocks.0.mlp" else "bf16"}  # noqa: E731
    with fake_world(2, 0):
        off = _program(GPT, 0).gm
        mixed = _program(GPT, 1, quantized).gm
    assert not any(isinstance(m, (GatherStart, GatherWait)) for m in off.modules())
    blocking = [n for n in mixed.graph.nodes if n.op == "call_module" and isinstance(mixed.get_submodule(n.target), Zero3Gather)]
    assert [mixed.get_submodule(n.target).spec.layer for n in blocking] == ["blocks.0.mlp"]
    assert mixed.get_submodule(blocking[0].target).spec.qdtype == "int8"


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_rewritten_graph_exports_with_fake_kernels():
    with fake_world(2, 0):
        gm = _program(GPT, 1).gm
        tokens = torch.zeros(2, SEQ, dtype=torch.long)
        ep = torch.export.export(gm, (tokens,), dynamic_shapes=({0: Dim("b", min=2, max=64)},), strict=False)
        assert A.pending_count() == 0  # tracing ran only fake kernels
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    starts = sum("autoshard.all_gather_start" in t for t in targets)
    start_nodes = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), GatherStart)]
    assert starts == sum("autoshard.all_gather_wait" in t for t in targets) == len(start_nodes) > 0


def test_start_wait_under_local_tensor_mode():
    with local_ranks(2) as ranks:
        x = ranks.per_rank(lambda r: torch.arange(6.0) + 10 * r)
        left, right = A.all_gather_wait(A.all_gather_start(x, None), 2, [2, 4])
        assert A.pending_count() == 0
        for shard in ranks.shards(left):
            assert torch.equal(shard, torch.tensor([[0.0, 1.0], [10.0, 11.0]]))
        for shard in ranks.shards(right):
            assert torch.equal(shard, torch.tensor([[2.0, 3, 4, 5], [12, 13, 14, 15]]))


def test_wait_argument_errors():
    with fake_world(2, 0):
        with pytest.raises(AutoshardError, match="split_sizes"):
            A.all_gather_wait(torch.zeros(8), 2, [3])
        with pytest.raises(AutoshardError, match="no pending collective"):
            A.all_gather_wait(torch.zeros(8), 2, [4])


# --------------------------------------------------------------------------- benchmarks/overlap_bench.py


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_bench.py"
    spec = importlib.util.spec_from_file_location("overlap_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def test_trace_summary_finds_next_gather_during_compute():
    bench = _bench()
    assert bench.interval_union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert bench.intersection_length([(0, 10)], [(2, 4), (3, 5), (8, 20)]) == 5
    # CPU: start0 [0,1) wait0 [1,2) start1 [2,3) (launches corr 1) compute launch corr 2 at 4, wait1 [10, 11)
    cpu = [_event("autoshard::all_gather_start", "cpu_op", 0, 1), _event("autoshard::all_gather_wait", "cpu_op", 1, 1),
           _event("autoshard::all_gather_start", "cpu_op", 2, 1), _event("autoshard::all_gather_wait", "cpu_op", 10, 1),
           _event("cudaLaunchKernelExC", "cuda_runtime", 2.5, 0.1, correlation=1),
           _event("cudaLaunchKernel", "cuda_runtime", 4, 0.1, correlation=2)]
    gpu = [_event("ncclDevKernel_AllGather_RING_LL", "kernel", 100, 50, stream=20, correlation=1),
           _event("ampere_bf16_gemm", "kernel", 120, 60, stream=7, correlation=2)]
    summary = bench.summarise_trace({"traceEvents": cpu + gpu}, num_gathers=2, num_layers=4)
    assert summary["nccl_kernel_s"] == pytest.approx(50e-6)
    assert summary["overlap_s"] == pytest.approx(30e-6) and summary["overlap_by_stream_s"] == {"20": pytest.approx(30e-6)}
    assert summary["layers"] == [{"layer": 0, "next_gather_kernels": 1, "compute_kernels": 1, "overlap_us": 30,
                                  "overlaps": True}]
    assert summary["compute_stream"] == "7" and summary["streams"]["20"] == {"nccl_ms": 0.05, "compute_ms": 0.0,
                                                                            "kernels": 1}
    assert summary["gpu_idle_s"] == pytest.approx(0.0) and summary["host_wait_ms"] == pytest.approx(2e-3)
    assert bench.summarise_trace({"traceEvents": cpu}, 2, 4)["layers"] is None  # CPU run: no kernels


@pytest.mark.slow
def test_bench_smoke_runs_both_modes(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "overlap.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_bench.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=240, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    off, on = report["modes"]
    assert (off["prefetch"], on["prefetch"]) == (0, 1) and off["forward_gathers"] == on["forward_gathers"] > 0
    assert on["losses"] == off["losses"]  # the overlap changes the schedule, not the numbers
    assert "| prefetch | median step (ms)" in proc.stdout
    assert "VERDICT: no GPU kernels" in proc.stdout and "(stable)" in proc.stdout
