"""Bucketed data-parallel collectives: one collective per bucket, numerics unchanged.

Pure tests of the bucket assignment, then one gloo job (world 2, llama:tiny)
that trains DDP / ZeRO-1 / ZeRO-2 / offload plans with ``bucket_bytes`` = 0
(one collective per parameter), a small size (several buckets) and the
default (everything in one bucket), counts the ``autoshard::`` collectives of
step 1 and compares the trained parameters with single-device training.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from _harness import run_gloo_cases
from _runtime_cases import check_against_reference, graph_of, make_plan, single_device, train_case
from autoshard.errors import AutoshardError
from autoshard.models import build
from autoshard.plan import Mesh
from autoshard.runtime import _buckets
from autoshard.runtime.optimizer import DEFAULT_BUCKET_BYTES, OptimizerConfig, ShardedOptimizer

SPEC = "llama:tiny"
MESH = Mesh(dp_shard=2)


# --------------------------------------------------------------------------- assignment (pure)


def test_assign_groups_by_key_in_order_and_caps_bytes():
    keys = ["a", "b", "a", None, "a", "b"]
    sizes = [40, 10, 40, 99, 40, 10]
    assert _buckets.assign(keys, sizes, 100) == [[0, 2], [1, 5], [4]]


def test_assign_oversized_member_gets_own_bucket_and_zero_disables():
    assert _buckets.assign(["k"] * 3, [5, 500, 5], 100) == [[0], [1], [2]]
    assert _buckets.assign(["k"] * 3, [1, 1, 1], 0) == [[0], [1], [2]]
    assert _buckets.assign(["k"] * 3, [1, 1, 1], 3) == [[0, 1, 2]]


def test_negative_bucket_bytes_is_a_user_error():
    with pytest.raises(AutoshardError, match="bucket_bytes=-1"):
        ShardedOptimizer({}, {}, {}, None, OptimizerConfig(), bucket_bytes=-1)


def test_reduce_scatter_layout_is_rank_major_per_member():
    """On one pretend rank pair, packing then taking row r equals each member's own chunk r."""
    grads = [torch.arange(5.0), torch.arange(3.0) + 10]
    chunks = [3, 2]  # ceil(5/2), ceil(3/2)
    rows = [torch.nn.functional.pad(g, (0, c * 2 - g.numel())).view(2, c) for g, c in zip(grads, chunks)]
    packed = torch.cat(rows, 1)  # (2, 5)
    torch.testing.assert_close(packed[1], torch.tensor([3.0, 4.0, 0.0, 12.0, 0.0]))


# --------------------------------------------------------------------------- gloo job


def _param_bytes() -> list[int]:
    return [p.numel() * 4 for p in build(SPEC).parameters()]  # fp32 compute


SMALL = sum(_param_bytes()) // 4  # forces several buckets
CASES = {f"{state}_{tag}": (state, size) for state in ("replicate", "zero2") for tag, size in
         (("per_param", 0), ("small", SMALL), ("default", DEFAULT_BUCKET_BYTES))}
CASES |= {"zero1_small": ("zero1", SMALL), "offload_small": ("offload", SMALL)}
BLOCKING = ("replicate_small", "zero2_small")  # also run with the gradient sync after backward


def _plan(state: str, bucket_bytes: int):
    plan = make_plan(SPEC, MESH, lambda _layer: {"state": state})
    return dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, bucket_bytes=bucket_bytes))


@pytest.fixture(scope="module")
def results():
    jobs = {name: functools.partial(train_case, spec=SPEC, graph=graph_of(SPEC), plan=_plan(*case), count=True,
                                    overlap_grad_sync=True) for name, case in CASES.items()}
    jobs |= {f"{name}_blocking": functools.partial(train_case, spec=SPEC, graph=graph_of(SPEC), plan=_plan(*CASES[name]),
                                                   count=True, overlap_grad_sync=False) for name in BLOCKING}
    return run_gloo_cases(jobs, 2, timeout_s=400)


def _syncs(result: dict, op: str) -> int:
    """Step 1's ``op`` collectives: the ``autoshard::`` calls plus the buckets launched from backward."""
    launched = result["overlap_launches"] if op in ("all_reduce", "reduce_scatter") else 0
    return result["counts"].get(op, 0) + launched


@pytest.fixture(scope="module")
def reference():
    return single_device(SPEC)


def _expected_buckets(bucket_bytes: int, pad_to: int = 1) -> int:
    """Buckets of the model's fp32 params (padded to whole dp chunks for flat states)."""
    sizes = [-(-b // (4 * pad_to)) * 4 * pad_to for b in _param_bytes()]
    return len(_buckets.assign(["k"] * len(sizes), sizes, bucket_bytes))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_bucketed_matches_single_device(results, reference, name):
    check_against_reference(results[name], reference, MESH)


@pytest.mark.slow
def test_ddp_all_reduces_per_bucket(results):
    num_params = len(_param_bytes())
    base = _syncs(results["replicate_per_param"][0], "all_reduce") - num_params  # loss / clip-norm all-reduces
    assert base >= 1
    small = _expected_buckets(SMALL)
    assert 2 <= small < num_params // 2
    assert _syncs(results["replicate_small"][0], "all_reduce") == base + small
    assert _syncs(results["replicate_default"][0], "all_reduce") == base + 1
    assert results["replicate_small_blocking"][0]["counts"]["all_reduce"] == base + small


@pytest.mark.parametrize("state", ["zero2", "zero1", "offload"])
@pytest.mark.slow
def test_flat_states_reduce_scatter_and_gather_per_bucket(results, state):
    result = results[f"{state}_small"][0]
    small = _expected_buckets(SMALL, pad_to=MESH.dp)
    assert small >= 2
    assert _syncs(result, "reduce_scatter") == small
    assert _gathers(result) == small
    # masters on the compute device: every bucket's gather launched under the next bucket's update (on the
    # CPU the offload "host" is that device too; on CUDA offloaded buckets are gathered blocking, after)
    assert result["counts"].get("all_gather_start", 0) == small
    assert "quantized_reduce_scatter" not in result["counts"]


def _gathers(result) -> int:
    """Parameter all-gathers of step 1, blocking or started (``ShardedOptimizer.step``)."""
    return result["counts"].get("all_gather", 0) + result["counts"].get("all_gather_start", 0)


@pytest.mark.slow
def test_zero2_per_param_vs_default(results):
    num_params = len(_param_bytes())
    per_param, default = results["zero2_per_param"][0], results["zero2_default"][0]
    assert _syncs(per_param, "reduce_scatter") == _gathers(per_param) == num_params
    assert _syncs(default, "reduce_scatter") == _gathers(default) == 1
    # loss / clip-norm only: ZeRO syncs never all-reduce
    assert default["counts"]["all_reduce"] == per_param["counts"]["all_reduce"]


@pytest.mark.parametrize("name", BLOCKING)
@pytest.mark.slow
def test_overlapped_sync_launches_from_backward_and_equals_blocking(results, name):
    """Every bucket of a DDP / ZeRO-2 step launches during the last backward (none is left to the
    blocking path), and the trained values are bit-identical to the sync after backward."""
    overlapped, blocking = results[name], results[f"{name}_blocking"]
    small = _expected_buckets(SMALL, pad_to=MESH.dp if name.startswith("zero") else 1)
    assert overlapped[0]["overlap_launches"] == small  # one step: each bucket once
    assert blocking[0]["overlap_launches"] == 0
    for a, b in zip(overlapped, blocking):
        assert a["losses"] == b["losses"]
        for fqn in a["shards"]:
            torch.testing.assert_close(a["shards"][fqn], b["shards"][fqn], rtol=0, atol=0)
