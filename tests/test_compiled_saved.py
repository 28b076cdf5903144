"""What inductor's partitioner would save, on meta tensors (``calibrate_probe.saved_bytes``,
``benchmarks/compiled_saved.py``).

The min-cut partitioner (compiled runtime) saves no more than the default one (eager-like), the
block term is positive and the same for every added block, and the default partitioner's
per-block bytes equal what capture measures from the eager model for the same block.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from autoshard.passes.capture import capture_reference
from autoshard.calibrate_probe import saved_bytes
from autoshard.cluster import Cluster
from benchmarks import compiled_saved

pytestmark = pytest.mark.slow  # every case compiles the model (seconds)

SPEC, SEQ, MB = "llama:tiny", 16, 2


@pytest.fixture(scope="module")
def sizes():
    return {name: [saved_bytes(SPEC, n, SEQ, MB, part) for n in (1, 2, 3)]
            for name, part in (("default", default_partition), ("mincut", min_cut_rematerialization_partition))}


def test_min_cut_saves_no_more_than_default(sizes):
    for n in range(3):
        assert 0 < sizes["mincut"][n] <= sizes["default"][n]


def test_each_block_adds_the_same_bytes(sizes):
    for name, (one, two, three) in sizes.items():
        assert two - one == three - two > 0, name


def test_default_partition_matches_capture_per_block(sizes):
    graph = capture_reference(SPEC, seq_lens=(SEQ // 2, SEQ), dtype=torch.bfloat16)
    block = [layer for layer in graph if layer.block == 1]
    captured = sum(layer.saved_bytes(MB, SEQ) for layer in block)
    per_block = sizes["default"][1] - sizes["default"][0]
    assert per_block == captured  # same bytes: both see what eager autograd keeps


def test_cli_writes_the_scale_into_a_calibration_file(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"layer_times": {"model": SPEC, "dtype": "bf16", "seq_len": SEQ, "samples": []}}))
    assert compiled_saved.main(["--model", SPEC, "--seq", str(SEQ), "--micro-batch", str(MB), "--into", str(cal)]) == 0
    scale = json.loads(cal.read_text())["layer_times"]["compiled_saved_scale"]
    assert 0 < scale < 1  # Llama's fp32 norm and RoPE chains are recomputed, not saved
    assert Cluster.preset("h100-sxm", 1, 2).with_calibration(cal).calibration["layer_times.compiled_saved_scale"] == scale
