"""Tests of kernels/collectives.py: the ``autoshard::`` collective custom ops.

In-process, under a fake process group: argument checks, shapes through
``torch.export`` (dynamic dims too), and the backward op of every op traced by
``make_fx``; the Megatron MLPs at world 4 under ``LocalTensorMode`` (one
process). Real numerics run in two spawned gloo jobs (world 2 and 4, every
case in one job each, ``opcheck`` in the world-2 job only): forward values and
gradients against single-process references built from the same seeded data.

Reference scheme for the per-rank-losses ops: every rank can build every
rank's input ``x_r`` and loss weights ``w_r``; the reference differentiates
``L = sum_r <w_r, y_r>`` in one process, and rank r checks its own output and
``dL/dx_r``. The TP/SP ops are checked through Megatron MLPs against the
unsharded MLP with one (replicated) loss.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.export import Dim
from torch.fx.experimental.proxy_tensor import make_fx

from _harness import fake_world, local_ranks, run_gloo_cases
from autoshard.errors import AutoshardError
from autoshard.kernels import collectives as C

# float64 for the op-level cases (any convention error is O(1)); float32 for the
# Megatron MLPs, compared to the unsharded MLP at rtol 1e-5 (atol covers
# reduction-order round-off of near-zero entries).
TOLERANCE = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-5}}

# --------------------------------------------------------------------------- helpers shared by the cases


def _device() -> torch.device:
    """cuda:<rank> inside an NCCL job (tests/test_collectives_gpu.py), else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _randn(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    """Seeded data, identical on every rank and backend (drawn on CPU, then moved)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(_device())


def _per_rank_losses(rank, world_size, make_x, dist_fn, ref_fn, loss_scale=1.0):
    """(actual, expected) of output and input gradient under L = loss_scale * sum_r <w_r, y_r>.

    Rank r backpropagates its own loss <w_r, y_r>; a ``loss_scale`` other than 1
    must come from the op under test (e.g. ``grad_op="avg"``).
    """
    xs = [make_x(r).requires_grad_() for r in range(world_size)]
    ys = ref_fn(xs)
    weights = [_randn(1000 + r, *y.shape) for r, y in enumerate(ys)]
    total = loss_scale * sum((w * y).sum() for w, y in zip(weights, ys))
    ref_grads = torch.autograd.grad(total, xs)

    x = make_x(rank).requires_grad_()
    y = dist_fn(x)
    (weights[rank] * y).sum().backward()
    return {"out": (y.detach(), ys[rank].detach()), "grad": (x.grad, ref_grads[rank])}


def _chunk(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size, dim)[rank]


# --------------------------------------------------------------------------- per-rank-losses cases


def case_all_gather(rank, world_size):
    results = {}
    for dim in (0, 1, -1):
        for grad_op, scale in (("sum", 1.0), ("avg", 1.0 / world_size)):
            checked = _per_rank_losses(
                rank,
                world_size,
                make_x=lambda r: _randn(r, 2, 3, 2),
                dist_fn=lambda x, d=dim, g=grad_op: C.all_gather(x, d, grad_op=g),
                ref_fn=lambda xs, d=dim: [torch.cat(xs, d)] * world_size,
                loss_scale=scale,
            )
            results.update({f"dim{dim}/{grad_op}/{k}": v for k, v in checked.items()})
    return results


def case_reduce_scatter(rank, world_size):
    results = {}
    for dim in (0, 1, -1):
        for op in ("sum", "avg"):
            divide = world_size if op == "avg" else 1
            checked = _per_rank_losses(
                rank,
                world_size,
                make_x=lambda r: _randn(r, 2 * world_size, world_size, world_size),
                dist_fn=lambda x, d=dim, o=op: C.reduce_scatter(x, d, op=o),
                ref_fn=lambda xs, d=dim, k=divide: list((sum(xs) / k).chunk(world_size, d)),
            )
            results.update({f"dim{dim}/{op}/{k}": v for k, v in checked.items()})
    xs = [_randn(r, world_size, 3) for r in range(world_size)]
    results["max/out"] = (C.reduce_scatter(xs[rank], 0, op="max"), _chunk(torch.stack(xs).amax(0), 0, rank, world_size))
    return results


def case_all_reduce(rank, world_size):
    results = {}
    for op in ("sum", "avg"):
        divide = world_size if op == "avg" else 1
        checked = _per_rank_losses(
            rank,
            world_size,
            make_x=lambda r: _randn(r, 3, 4),
            dist_fn=lambda x, o=op: C.all_reduce(x, op=o),
            ref_fn=lambda xs, k=divide: [sum(xs) / k] * world_size,
        )
        results.update({f"{op}/{k}": v for k, v in checked.items()})
    xs = [_randn(r, 5) for r in range(world_size)]
    results["min/out"] = (C.all_reduce(xs[rank], op="min"), torch.stack(xs).amin(0))
    return results


def _a2a_splits(world_size):
    """send[r][j]: rows rank r sends to rank j (uneven, some zero)."""
    return [[(r + 2 * j) % 3 for j in range(world_size)] for r in range(world_size)]


def _a2a_reference(xs, send):
    world_size = len(xs)
    pieces = [x.split(send[r]) for r, x in enumerate(xs)]  # pieces[r][j]: from r to j
    return [torch.cat([pieces[r][j] for r in range(world_size)]) for j in range(world_size)]


def case_all_to_all(rank, world_size):
    send = _a2a_splits(world_size)
    recv = [send[j][rank] for j in range(world_size)]
    return _per_rank_losses(
        rank,
        world_size,
        make_x=lambda r: _randn(r, sum(send[r]), 3),
        dist_fn=lambda x: C.all_to_all(x, recv, send[rank]),
        ref_fn=lambda xs: _a2a_reference(xs, send),
    )


# --------------------------------------------------------------------------- TP / SP cases (replicated loss)


def _mlp_weights(hidden):
    f32 = torch.float32
    return _randn(1, hidden, 4 * hidden, dtype=f32), _randn(2, 4 * hidden, hidden, dtype=f32)  # A (h, 4h), B (4h, h)


def _mlp_reference(x, a, b, w):
    """Unsharded MLP: loss, output, and grads of x, A, B."""
    x, a, b = (t.clone().requires_grad_() for t in (x, a, b))
    out = F.gelu(x @ a) @ b
    loss = (w * out).sum()
    loss.backward()
    return loss.detach(), out.detach(), x.grad, a.grad, b.grad


def _megatron_mlp(rank, world_size, enter, leave):
    """Column-parallel A, row-parallel B; ``enter``/``leave`` are the boundary ops under test."""
    hidden = 8
    x, w = _randn(3, 2, 5, hidden, dtype=torch.float32), _randn(4, 2, 5, hidden, dtype=torch.float32)  # (b, s, h)
    a, b = _mlp_weights(hidden)
    ref_loss, ref_out, ref_gx, ref_ga, ref_gb = _mlp_reference(x, a, b, w)

    xl = x.clone().requires_grad_()
    a_r = _chunk(a, 1, rank, world_size).clone().requires_grad_()  # (h, 4h/t)
    b_r = _chunk(b, 0, rank, world_size).clone().requires_grad_()  # (4h/t, h)
    out = leave(F.gelu(enter(xl) @ a_r) @ b_r)  # (b, s, h), replicated
    loss = (w * out).sum()
    loss.backward()
    return {
        "loss": (loss.detach(), ref_loss),
        "out": (out.detach(), ref_out),
        "grad_x": (xl.grad, ref_gx),
        "grad_a": (a_r.grad, _chunk(ref_ga, 1, rank, world_size)),
        "grad_b": (b_r.grad, _chunk(ref_gb, 0, rank, world_size)),
    }


def case_megatron_tp_mlp(rank, world_size):
    return _megatron_mlp(rank, world_size, enter=C.copy_to_tp, leave=C.reduce_from_tp)


def case_tp_mlp_with_per_rank_loss_ops(rank, world_size):
    """The wrong convention for TP (identity in, all_reduce out): shows the reference test has teeth."""
    return _megatron_mlp(rank, world_size, enter=lambda t: t, leave=C.all_reduce)


def case_megatron_sp_mlp(rank, world_size):
    """SP: sequence-sharded input, gather before column-parallel, reduce-scatter after row-parallel."""
    hidden, seq = 8, 2 * world_size
    x, w = _randn(3, seq, 2, hidden, dtype=torch.float32), _randn(4, seq, 2, hidden, dtype=torch.float32)  # (s, b, h)
    a, b = _mlp_weights(hidden)
    ref_loss, ref_out, ref_gx, ref_ga, ref_gb = _mlp_reference(x, a, b, w)

    x_r = _chunk(x, 0, rank, world_size).clone().requires_grad_()  # (s/t, b, h)
    a_r = _chunk(a, 1, rank, world_size).clone().requires_grad_()
    b_r = _chunk(b, 0, rank, world_size).clone().requires_grad_()
    full = C.gather_from_sp(x_r, 0, grad_is_partial=True)  # (s, b, h)
    out_r = C.reduce_scatter(F.gelu(full @ a_r) @ b_r, 0)  # (s/t, b, h)
    loss_r = (_chunk(w, 0, rank, world_size) * out_r).sum()
    loss_r.backward()
    total = loss_r.detach().clone()
    dist.all_reduce(total)
    return {
        "loss": (total, ref_loss),
        "out": (out_r.detach(), _chunk(ref_out, 0, rank, world_size)),
        "grad_x": (x_r.grad, _chunk(ref_gx, 0, rank, world_size)),
        "grad_a": (a_r.grad, _chunk(ref_ga, 1, rank, world_size)),
        "grad_b": (b_r.grad, _chunk(ref_gb, 0, rank, world_size)),
    }


def case_sp_replicated_region(rank, world_size):
    """scatter_to_sp -> per-position work -> gather_from_sp(grad_is_partial=False), replicated loss."""
    seq, hidden = 2 * world_size, 4
    x, w, gamma = _randn(5, seq, 3, hidden), _randn(6, seq, 3, hidden), _randn(7, hidden)

    def region(t, g):
        return torch.tanh(t) * g

    xr, gr = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    (w * region(xr, gr)).sum().backward()

    xl, gl = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    shard = C.scatter_to_sp(xl, 0)  # (s/t, b, h)
    full = C.gather_from_sp(region(shard, gl), 0, grad_is_partial=False)  # (s, b, h)
    (w * full).sum().backward()
    gamma_grad = gl.grad.clone()
    dist.all_reduce(gamma_grad)  # SP parameters' grads are partial per sequence shard
    return {
        "shard": (shard.detach(), _chunk(x, 0, rank, world_size)),
        "grad_x": (xl.grad, xr.grad),
        "grad_gamma_summed": (gamma_grad, gr.grad),
    }


# --------------------------------------------------------------------------- opcheck (world 2 only)


_OPS = ("all_gather", "reduce_scatter", "all_reduce", "copy_to_tp", "reduce_from_tp",
        "scatter_to_sp", "gather_from_sp", "all_to_all")


def _opcheck_samples():
    n = dist.get_world_size()
    x = _randn(0, 2 * n, 2 * n, 2)  # every split dim divisible by n
    name = dist.group.WORLD.group_name
    return {
        "all_gather": (x, 1, name, "sum"),
        "reduce_scatter": (x, 0, name, "sum"),
        "all_reduce": (x, name, "avg"),
        "copy_to_tp": (x, name),
        "reduce_from_tp": (x, name),
        "scatter_to_sp": (x, 1, name),
        "gather_from_sp": (x, 1, name, False),
        "all_to_all": (x, [2] * n, [2] * n, name),
    }


def case_opcheck(rank, world_size):
    results = {}
    for op_name, args in _opcheck_samples().items():
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
        report = torch.library.opcheck(getattr(torch.ops.autoshard, op_name).default, args, raise_exception=False)
        results[op_name] = {test: str(outcome) for test, outcome in report.items()}
    return results


def case_eager_fast_path(rank, world_size):
    """The public wrappers' eager fast path vs the torch.library dispatch: same values and gradients, and which ran.

    kernels/collectives.py note "eager fast path": plain tensors with nothing tracing take
    ``_Direct``; under a dispatch mode the same wrapper goes through ``torch.ops.autoshard``.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoshard.kernels import async_collectives as A

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def run(fn):
        x = _randn(100 + rank, world_size * 4, 3).requires_grad_()
        out = fn(x)
        outs = out if isinstance(out, list) else [out]
        weights = [_randn(7 + i, *o.shape) for i, o in enumerate(outs)]
        sum((o * w).sum() for o, w in zip(outs, weights)).backward()
        return [o.detach() for o in outs], x.grad, type(outs[0].grad_fn).__name__

    def start_wait(x):
        return A.all_gather_wait(A.all_gather_start(x, None, "avg"), world_size, [5, world_size * 12 - 5])

    fns = {"all_gather": lambda x: C.all_gather(x, 0, None, "avg"),
           "reduce_scatter": lambda x: C.reduce_scatter(x, 0, None, "avg"),
           "all_reduce": lambda x: C.all_reduce(x, None, "sum"),
           "start_wait": start_wait}
    checks, paths = {}, {}
    for name, fn in fns.items():
        fast, fast_grad, fast_node = run(fn)
        with Passthrough():
            slow, slow_grad, slow_node = run(fn)
        for i, (a, b) in enumerate(zip(fast, slow)):
            checks[f"{name}[{i}]"] = (a, b)
        checks[f"{name}.grad"] = (fast_grad, slow_grad)
        paths[name] = (fast_node, slow_node)
    # the asynchronous reduce-scatter of backward (kernels/async_collectives.py note "async reduce-scatter")
    flat = _randn(200 + rank, world_size * 6)
    for op in ("avg", "sum"):
        handle = A.reduce_scatter_start(flat, C.group_name_of(None), op)
        checks[f"reduce_scatter_start/{op}"] = (A.finish(handle), C.reduce_scatter(flat, 0, None, op))
    return {"checks": checks, "paths": paths, "pending": A.pending_count()}


# --------------------------------------------------------------------------- the two jobs

NUMERIC_CASES = {
    "all_gather": case_all_gather,
    "reduce_scatter": case_reduce_scatter,
    "all_reduce": case_all_reduce,
    "all_to_all": case_all_to_all,
    "megatron_tp_mlp": case_megatron_tp_mlp,
    "tp_mlp_with_per_rank_loss_ops": case_tp_mlp_with_per_rank_loss_ops,
    "megatron_sp_mlp": case_megatron_sp_mlp,
    "sp_replicated_region": case_sp_replicated_region,
}
CHECKED_CASES = sorted(set(NUMERIC_CASES) - {"tp_mlp_with_per_rank_loss_ops"})


@pytest.fixture(scope="module")
def gloo_world2():
    return run_gloo_cases({**NUMERIC_CASES, "opcheck": case_opcheck, "eager_fast_path": case_eager_fast_path}, 2,
                          timeout_s=180)


@pytest.fixture(scope="module")
def gloo_world4():
    return run_gloo_cases(NUMERIC_CASES, 4, timeout_s=180)


@pytest.fixture(params=[2, 4], ids=lambda n: f"world{n}")
def gloo_results(request):
    """(world size, {case: [per-rank result]}) from the one job of that world size."""
    return request.param, request.getfixturevalue(f"gloo_world{request.param}")


@pytest.mark.parametrize("case", CHECKED_CASES)
@pytest.mark.slow
def test_numerics_match_single_process_reference(gloo_results, case):
    world_size, results = gloo_results
    check_case_results(case, world_size, results)


def check_case_results(case: str, world_size: int, results) -> None:
    """Every (actual, expected) pair of every rank of ``case`` agrees (shared with the GPU tests)."""
    for rank, checks in enumerate(results[case]):
        assert checks, f"case {case} checked nothing"
        for key, (actual, expected) in checks.items():
            torch.testing.assert_close(
                actual, expected, **TOLERANCE[expected.dtype], msg=lambda m: f"{case}[{key}] rank {rank}/{world_size}: {m}"
            )


@pytest.mark.slow
def test_per_rank_loss_all_reduce_is_wrong_for_tp(gloo_results):
    world_size, results = gloo_results
    check_per_rank_loss_ops_are_wrong_for_tp(world_size, results)


def check_per_rank_loss_ops_are_wrong_for_tp(world_size: int, results) -> None:
    """With DP-flavour ops a replicated loss counts t times: fc2 grads scale by t, fc1 grads are wrong."""
    for checks in results["tp_mlp_with_per_rank_loss_ops"]:
        torch.testing.assert_close(*checks["loss"], **TOLERANCE[torch.float32])  # forward is identical
        actual_b, expected_b = checks["grad_b"]
        torch.testing.assert_close(actual_b, world_size * expected_b, **TOLERANCE[torch.float32])
        assert not torch.allclose(*checks["grad_x"], rtol=1e-3)


@pytest.mark.slow
def test_eager_fast_path_equals_dispatch(gloo_world2):
    """Fast path and torch.library dispatch give bit-identical values and gradients; each path ran where meant."""
    for result in gloo_world2["eager_fast_path"]:
        for key, (fast, slow) in result["checks"].items():
            assert torch.equal(fast, slow), key
        for name, (fast_node, slow_node) in result["paths"].items():
            assert fast_node == "_DirectBackward", (name, fast_node)
            assert slow_node != "_DirectBackward", (name, slow_node)
        assert result["pending"] == 0


@pytest.mark.slow
def test_opcheck_passes(gloo_world2):
    """torch.library.opcheck on real gloo data: schema, autograd registration, fake kernel, AOT dispatch."""
    check_opcheck_reports(gloo_world2["opcheck"])


def check_opcheck_reports(per_rank_reports) -> None:
    expected_tests = {"test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"}
    for rank_report in per_rank_reports:
        assert set(rank_report) == set(_OPS), "opcheck skipped an op"
        for op_name, report in rank_report.items():
            assert expected_tests <= set(report), f"opcheck autoshard::{op_name} ran only {sorted(report)}"
            failures = {test: outcome for test, outcome in report.items() if outcome != "SUCCESS"}
            assert not failures, f"opcheck autoshard::{op_name}: {failures}"


# --------------------------------------------------------------------------- fake process group: shapes, export, autograd wiring

WORLD = 8


def _export_cases():
    """(name, fn, example input shape, dynamic tensor dim, expected output shape for an input shape)."""
    n = WORLD
    return [
        ("all_gather", lambda x: C.all_gather(x, 1), (3, 4, 5), 0, lambda s: (s[0], s[1] * n, s[2])),
        ("reduce_scatter", lambda x: C.reduce_scatter(x, -1, op="avg"), (3, 4, 16), 0, lambda s: (*s[:2], s[2] // n)),
        ("all_reduce", lambda x: C.all_reduce(x), (3, 4, 5), 2, lambda s: s),
        ("copy_to_tp", lambda x: C.copy_to_tp(x), (3, 4, 5), 2, lambda s: s),
        ("reduce_from_tp", lambda x: C.reduce_from_tp(x), (3, 4, 5), 2, lambda s: s),
        ("scatter_to_sp", lambda x: C.scatter_to_sp(x, 1), (3, 16, 5), 2, lambda s: (s[0], s[1] // n, s[2])),
        ("gather_from_sp", lambda x: C.gather_from_sp(x, 1), (3, 2, 5), 0, lambda s: (s[0], s[1] * n, s[2])),
        ("all_to_all", lambda x: C.all_to_all(x, [1] * n, [2] * n), (16, 4, 5), 2, lambda s: (n, s[1], s[2])),
    ]


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("name,fn,shape,dynamic_dim,expected", _export_cases(), ids=[c[0] for c in _export_cases()])
def test_export_traces_op_with_fake_kernel(name, fn, shape, dynamic_dim, expected):
    """Export with one dynamic dim; the exported program runs at the example and at a larger size."""
    with fake_world(WORLD, rank=3):
        dynamic = {dynamic_dim: Dim("d", min=2)}
        ep = torch.export.export(_Wrap(fn), (torch.randn(*shape),), dynamic_shapes=(dynamic,))
        targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        assert getattr(torch.ops.autoshard, name).default in targets
        assert ep.range_constraints, "the dynamic dim was specialised away"
        bigger = list(shape)
        bigger[dynamic_dim] += 3
        for s in (tuple(shape), tuple(bigger)):
            assert tuple(ep.module()(torch.randn(*s)).shape) == tuple(expected(s))


BACKWARD_OPS = [
    ("all_gather", functools.partial(C.all_gather, dim=0), {"reduce_scatter"}),
    ("reduce_scatter", functools.partial(C.reduce_scatter, dim=0), {"all_gather"}),
    ("all_reduce", C.all_reduce, {"all_reduce"}),
    ("copy_to_tp", C.copy_to_tp, {"all_reduce"}),
    ("reduce_from_tp", C.reduce_from_tp, set()),
    ("scatter_to_sp", functools.partial(C.scatter_to_sp, dim=0), {"all_gather"}),
    ("gather_from_sp/partial", functools.partial(C.gather_from_sp, dim=0), {"reduce_scatter"}),
    ("gather_from_sp/replicated", functools.partial(C.gather_from_sp, dim=0, grad_is_partial=False), {"scatter_to_sp"}),
    ("all_to_all", functools.partial(C.all_to_all, split_sizes_out=[2] * WORLD, split_sizes_in=[1] * WORLD), {"all_to_all"}),
]


@pytest.mark.parametrize("name,fn,backward_ops", BACKWARD_OPS, ids=[b[0] for b in BACKWARD_OPS])
def test_backward_is_the_documented_collective(name, fn, backward_ops):
    def fwd_bwd(x):
        y = fn(x)
        return torch.autograd.grad(y, x, torch.ones_like(y))

    with fake_world(WORLD):
        gm = make_fx(fwd_bwd, tracing_mode="fake")(torch.randn(WORLD, 3, requires_grad=True))
    ops = [n.target.name().split("::")[1].split(".")[0] for n in gm.graph.nodes
           if n.op == "call_function" and n.target.namespace == "autoshard"]
    forward = name.split("/")[0]
    assert ops[0] == forward
    assert set(ops[1:]) == backward_ops


# --------------------------------------------------------------------------- one process, all ranks (LocalTensorMode)


def _leaf(lr, make):
    return lr.per_rank(make).requires_grad_()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_local_ranks_megatron_mlp_matches_unsharded(sequence_parallel):
    """The TP (f/g) and SP (gather/reduce-scatter) MLPs at world 4, simulated in this process."""
    world, hidden, seq = 4, 8, 8
    f32 = torch.float32
    x, w = _randn(3, seq, 2, hidden, dtype=f32), _randn(4, seq, 2, hidden, dtype=f32)  # (s, b, h)
    a, b = _mlp_weights(hidden)
    ref_loss, ref_out, ref_gx, ref_ga, ref_gb = _mlp_reference(x, a, b, w)
    seq_dim = 0 if sequence_parallel else None
    with local_ranks(world) as lr:
        x_in = _leaf(lr, lambda r: _chunk(x, 0, r, world).clone() if sequence_parallel else x.clone())
        a_r = _leaf(lr, lambda r: _chunk(a, 1, r, world).clone())
        b_r = _leaf(lr, lambda r: _chunk(b, 0, r, world).clone())
        w_r = lr.per_rank(lambda r: _chunk(w, 0, r, world).clone() if sequence_parallel else w.clone())
        if sequence_parallel:
            out = C.reduce_scatter(F.gelu(C.gather_from_sp(x_in, seq_dim) @ a_r) @ b_r, seq_dim)
        else:
            out = C.reduce_from_tp(F.gelu(C.copy_to_tp(x_in) @ a_r) @ b_r)
        loss = (w_r * out).sum()
        loss.backward()
        shards = {name: lr.shards(t) for name, t in
                  {"loss": loss.detach(), "out": out.detach(), "x": x_in.grad, "a": a_r.grad, "b": b_r.grad}.items()}
    tol = TOLERANCE[f32]
    for r in range(world):
        expect_rows = (lambda t: _chunk(t, 0, r, world)) if sequence_parallel else (lambda t: t)
        torch.testing.assert_close(shards["out"][r], expect_rows(ref_out), **tol)
        torch.testing.assert_close(shards["x"][r], expect_rows(ref_gx), **tol)
        torch.testing.assert_close(shards["a"][r], _chunk(ref_ga, 1, r, world), **tol)
        torch.testing.assert_close(shards["b"][r], _chunk(ref_gb, 0, r, world), **tol)
    total = sum(shards["loss"]) if sequence_parallel else shards["loss"][0]
    torch.testing.assert_close(total, ref_loss, **tol)


def test_local_ranks_scatter_to_sp_takes_each_ranks_chunk():
    world = 4
    x = _randn(0, 8, 3)
    with local_ranks(world) as lr:
        shard = C.scatter_to_sp(lr.replicated(x).requires_grad_(), 0)
        shards = lr.shards(shard.detach())
    for r in range(world):
        torch.testing.assert_close(shards[r], _chunk(x, 0, r, world))


# --------------------------------------------------------------------------- user errors


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: C.reduce_scatter(torch.randn(6, 2), 0), "size 6, not divisible by the group size 4"),
        (lambda: C.scatter_to_sp(torch.randn(2, 3), 1), "size 3, not divisible"),
        (lambda: C.all_gather(torch.randn(2, 3), 2), r"dim=2 is out of range .* allowed \[-2, 1\]"),
        (lambda: C.all_reduce(torch.randn(2), op="prod"), r"op='prod' is not one of \('sum', 'avg', 'max', 'min'\)"),
        (lambda: C.all_to_all(torch.randn(4, 2), [1] * 4, [1, 1, 1]), r"split_sizes_in=\[1, 1, 1\] must hold 4"),
        (lambda: C.all_to_all(torch.randn(5, 2), [1] * 4, [1] * 4), "sums to 4 but the input has 5 rows"),
        (lambda: C.all_reduce(torch.randn(2), group="no-such-group"), "no process group named 'no-such-group'"),
    ],
)
def test_bad_arguments_raise_autoshard_errors(call, match):
    with fake_world(4):
        with pytest.raises(AutoshardError, match=match):
            call()


def test_max_has_no_gradient():
    with fake_world(4):
        y = C.all_reduce(torch.randn(3, requires_grad=True), op="max")
        with pytest.raises(AutoshardError, match=r"op='max' has no gradient"):
            y.sum().backward()


def test_default_group_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(AutoshardError, match="init_process_group"):
        C.all_reduce(torch.randn(2))
