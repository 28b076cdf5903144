"""GPU (NCCL) runs of the collective cases of tests/test_collectives.py; never in CI.

The same seeded cases, checked the same way, with every tensor on ``cuda:<rank>``.
Skips without enough GPUs. Run: ``pytest tests/test_collectives_gpu.py -m gpu``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._pytree import tree_map

from _harness import run_nccl_cases
from test_collectives import (
    CHECKED_CASES,
    NUMERIC_CASES,
    case_opcheck,
    check_case_results,
    check_opcheck_reports,
    check_per_rank_loss_ops_are_wrong_for_tp,
)

pytestmark = pytest.mark.gpu


def _on_cpu(case, rank: int, world_size: int):
    """Run ``case`` on the rank's GPU; return its tensors on the CPU for the parent."""
    results = case(rank, world_size)
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, results)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def nccl_results(request):
    cases = {**NUMERIC_CASES, "opcheck": case_opcheck}
    wrapped = {name: functools.partial(_on_cpu, case) for name, case in cases.items()}
    return request.param, run_nccl_cases(wrapped, request.param)


@pytest.mark.parametrize("case", CHECKED_CASES)
def test_nccl_numerics_match_single_process_reference(nccl_results, case):
    world_size, results = nccl_results
    check_case_results(case, world_size, results)


def test_nccl_per_rank_loss_ops_are_wrong_for_tp(nccl_results):
    check_per_rank_loss_ops_are_wrong_for_tp(*nccl_results)


def test_nccl_opcheck(nccl_results):
    check_opcheck_reports(nccl_results[1]["opcheck"])
