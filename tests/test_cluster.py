"""Cluster model: presets, addressing, files, units, validation, queries, calibration, detection."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from autoshard import cluster_detect, cluster_io, cluster_presets
from autoshard.cluster import Cluster, DeviceSpec, LinkSpec
from autoshard.errors import AutoshardError, ClusterError

GPU_PRESETS = ("h100-sxm", "h200", "a100-80gb", "h100-pcie")

# `nvidia-smi topo -m` as captured (piped) on a 2×H200 machine: the header is underlined with ANSI escapes.
TOPO_2X_NVLINK = (
    "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\t0-31\t0\t\tN/A\n"
    "GPU1\tNV18\t X \t0-31\t0\t\tN/A\n\nLegend:\n\n  X    = Self\n"
    "  PIX  = Connection traversing at most a single PCIe bridge\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
)
TOPO_4X_PCIE = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\n"
    "GPU0\t X \tPIX\tSYS\tSYS\t0-15\n"
    "GPU1\tPIX\t X \tSYS\tSYS\t0-15\n"
    "GPU2\tSYS\tSYS\t X \tPIX\t16-31\n"
    "GPU3\tSYS\tSYS\tPIX\t X \t16-31\n"
)
TOPO_1X = "\tGPU0\tCPU Affinity\nGPU0\t X \t0-15\n"


def _device(**overrides) -> DeviceSpec:
    fields = dict(name="dev", memory_bytes=2**30, peak_flops={"fp32": 1e12, "bf16": 2e12}, hbm_bandwidth=1e12)
    return DeviceSpec(**{**fields, **overrides})


def _cluster(**overrides) -> Cluster:
    fields = dict(name="c", nodes=2, devices_per_node=4, device=_device(), intra_node=LinkSpec(1e11, 5e-6),
                  inter_node=LinkSpec(1e10, 1e-5), host_bandwidth=2e10)
    return Cluster(**{**fields, **overrides})


# ---------------------------------------------------------------- presets


def test_preset_figures_follow_the_references():
    h100, h200, a100 = (Cluster.preset(n) for n in ("h100-sxm", "h200", "a100-80gb"))
    assert h100.peak_flops("bf16") == h200.peak_flops("bf16") == 989e12
    assert h100.peak_flops("fp8") == pytest.approx(2 * h100.peak_flops("bf16"), rel=1e-3)
    assert h100.peak_flops("fp32") == pytest.approx(67e12, rel=0.01)
    assert (a100.peak_flops("bf16"), a100.peak_flops("fp32")) == (312e12, 19.5e12)
    assert [c.device.hbm_bandwidth for c in (h100, h200, a100)] == pytest.approx([3.35e12, 4.8e12, 2.04e12], rel=1e-2)
    assert h100.intra_node.bandwidth == h200.intra_node.bandwidth == 370e9
    assert a100.intra_node.bandwidth == 230e9
    assert 46e9 <= h100.inter_node.bandwidth <= 48e9 and 5e-6 <= h100.intra_node.latency <= 10e-6
    assert (h100.host_bandwidth, a100.host_bandwidth) == (50e9, 25e9)
    assert h100.device.matmul_efficiency == pytest.approx(790 / 989, abs=0.01)
    assert h100.achieved_flops("bf16") == pytest.approx(0.8 * 989e12)
    assert all(79 * 2**30 < c.device.memory_bytes < 80 * 2**30 for c in (h100, a100))
    assert 139 * 2**30 < h200.device.memory_bytes < 141 * 2**30


@pytest.mark.parametrize("name", [*GPU_PRESETS, "cpu"])
def test_every_preset_builds_round_trips_and_describes(name):
    cluster = Cluster.preset(name, nodes=2)
    assert cluster.devices_per_node == (1 if name == "cpu" else 8)
    assert cluster.name == f"{name}:2x{cluster.devices_per_node}"
    assert cluster.intra_node.bandwidth > cluster.inter_node.bandwidth
    assert cluster.link_for(cluster.world_size) is cluster.inter_node
    data = json.loads(json.dumps(cluster.to_dict()))
    assert Cluster.from_dict(data) == cluster
    assert Cluster.from_dict(data).fingerprint() == cluster.fingerprint()


def test_preset_names_are_case_insensitive_and_aliased():
    assert Cluster.preset("H100-SXM") == Cluster.preset("h100-sxm")
    assert Cluster.preset("a100", nodes=2).device == Cluster.preset("a100-80gb").device
    assert Cluster.preset("cpu", devices_per_node=4).world_size == 4


def test_unknown_preset_lists_presets():
    with pytest.raises(ClusterError) as err:
        Cluster.preset("tpu-v5")
    assert "'tpu-v5'" in str(err.value)
    for name in (*GPU_PRESETS, "cpu"):
        assert name in str(err.value)


# ---------------------------------------------------------------- preset strings


@pytest.mark.parametrize(
    "text,nodes,devices",
    [("h100-sxm:4x8", 4, 8), ("cpu:1x2", 1, 2), ("h200", 1, 8), ("cpu", 1, 1), (" A100:2x4 ", 2, 4)],
)
def test_parse(text, nodes, devices):
    cluster = Cluster.parse(text)
    assert (cluster.nodes, cluster.devices_per_node, cluster.world_size) == (nodes, devices, nodes * devices)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("h100:0x8", "nodes '0'"),
        ("h100-sxm:4x0", "devices per node '0'"),
        ("h100-sxm:4by8", "PRESET[:NODESxDEVICES]"),
        ("h100-sxm:4x", "devices per node ''"),
        ("h100-sxm:x8", "nodes ''"),
        ("h100-sxm:-1x8", "nodes '-1'"),
        ("h100-sxm:4x8x2", "PRESET[:NODESxDEVICES]"),
        ("", "PRESET[:NODESxDEVICES]"),
        ("nope:1x8", "presets: a100-80gb, cpu, h100-pcie, h100-sxm, h200"),
    ],
)
def test_parse_rejects_malformed_strings(text, needle):
    with pytest.raises(ClusterError) as err:
        Cluster.parse(text)
    assert needle in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, AutoshardError)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"memory_bytes": 0}, "DeviceSpec.memory_bytes=0"),
        ({"memory_bytes": -5}, "DeviceSpec.memory_bytes=-5"),
        ({"memory_bytes": 1.5e9}, "positive integer"),
        ({"name": ""}, "DeviceSpec.name=''"),
        ({"hbm_bandwidth": 0.0}, "DeviceSpec.hbm_bandwidth=0.0"),
        ({"hbm_bandwidth": math.inf}, "DeviceSpec.hbm_bandwidth=inf"),
        ({"matmul_efficiency": 0.0}, "in (0, 1]"),
        ({"matmul_efficiency": 1.5}, "DeviceSpec.matmul_efficiency=1.5"),
        ({"hbm_efficiency": -0.1}, "DeviceSpec.hbm_efficiency=-0.1"),
        ({"peak_flops": {"fp32": 1e12, "bf16": 1e12, "fp64": 1e12}}, "'fp64': unknown dtype key"),
        ({"peak_flops": {"fp32": 1e12}}, "missing dtype(s) ['bf16']"),
        ({"peak_flops": {"fp32": 1e12, "bf16": -1.0}}, "DeviceSpec.peak_flops['bf16']=-1.0"),
    ],
)
def test_device_validation(overrides, needle):
    with pytest.raises(ClusterError) as err:
        _device(**overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "bandwidth,latency,needle",
    [(0, 1e-6, "LinkSpec.bandwidth=0"), (-1e9, 0, "LinkSpec.bandwidth=-1000000000.0"),
     (1e9, -1e-6, "LinkSpec.latency=-1e-06"), (1e9, math.nan, "LinkSpec.latency=nan"), (True, 0, "bandwidth=True")],
)
def test_link_validation(bandwidth, latency, needle):
    with pytest.raises(ClusterError) as err:
        LinkSpec(bandwidth, latency)
    assert needle in str(err.value)
    assert LinkSpec(1e9, 0).time(2e9) == 2.0  # latency 0 is allowed; α + M/β


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"nodes": 0}, "Cluster.nodes=0"),
        ({"nodes": True}, "Cluster.nodes=True"),
        ({"devices_per_node": 0}, "Cluster.devices_per_node=0"),
        ({"devices_per_node": 2.0}, "positive integer"),
        ({"host_bandwidth": 0}, "Cluster.host_bandwidth=0"),
        ({"host_memory_bytes": -1}, "Cluster.host_memory_bytes=-1"),
        ({"cpu_adam_params_per_s": 0}, "Cluster.cpu_adam_params_per_s=0"),
        ({"intra_node": (1e9, 1e-6)}, "must be a LinkSpec"),
        ({"name": ""}, "Cluster.name=''"),
    ],
)
def test_cluster_validation(overrides, needle):
    with pytest.raises(ClusterError) as err:
        _cluster(**overrides)
    assert needle in str(err.value)


def test_frozen_hashable_and_detached_from_inputs():
    flops = {"fp32": 1e12, "bf16": 2e12}
    cluster = _cluster(device=_device(peak_flops=flops))
    flops["bf16"] = 1.0
    assert cluster.peak_flops("bf16") == 2e12
    with pytest.raises(dataclasses.FrozenInstanceError):
        cluster.nodes = 3
    assert {cluster: 1}[_cluster(device=_device(peak_flops={"bf16": 2e12, "fp32": 1e12}))] == 1
    assert Cluster.preset("cpu", devices_per_node=1).host_memory_bytes == 16 * 2**30


# ---------------------------------------------------------------- queries


def _brute_force_spans(world: int, devices_per_node: int, size: int, stride: int) -> bool:
    """Groups of one row-major mesh axis, spelled out with numpy, checked rank by rank."""
    ranks = np.arange(world).reshape(world // (size * stride), size, stride)
    groups = ranks.transpose(0, 2, 1).reshape(-1, size)
    return bool(((groups // devices_per_node) != (groups[:, :1] // devices_per_node)).any())


@pytest.mark.parametrize("nodes,devices_per_node", [(1, 8), (2, 8), (3, 8), (4, 6), (2, 3), (5, 1)])
def test_group_spans_nodes_matches_enumeration(nodes, devices_per_node):
    cluster = _cluster(nodes=nodes, devices_per_node=devices_per_node)
    world = cluster.world_size
    for size in (s for s in range(1, world + 1) if world % s == 0):
        for stride in (s for s in range(1, world // size + 1) if (world // size) % s == 0):
            expected = _brute_force_spans(world, devices_per_node, size, stride)
            assert cluster.group_spans_nodes(size, stride) == expected, (size, stride)
            assert cluster.link_for(size, stride) is (cluster.inter_node if expected else cluster.intra_node)


def test_spanning_group_gets_the_bottleneck_of_both_levels():
    odd = _cluster(intra_node=LinkSpec(1e10, 1e-6, "pcie"), inter_node=LinkSpec(4e10, 1e-5, "ib"))
    assert odd.link_for(8, 1) == LinkSpec(1e10, 1e-5, "ib+pcie")
    assert odd.link_for(4, 1) == odd.intra_node


def test_link_for_typical_meshes():
    cluster = Cluster.parse("h100-sxm:4x8")
    assert cluster.link_for(8, 1) == cluster.intra_node  # tp = 8 inside a node
    assert cluster.link_for(4, 8) == cluster.inter_node  # dp across nodes
    assert cluster.link_for(2, 4) == cluster.intra_node  # pairs of half-nodes
    assert cluster.link_for(16, 1) == cluster.inter_node
    assert Cluster.parse("h100-sxm:3x8").group_spans_nodes(3, 1)  # the group {6, 7, 8} straddles a boundary
    assert not cluster.group_spans_nodes(1, 32)


def test_node_of_and_bad_group_arguments():
    cluster = Cluster.parse("h100-sxm:2x8")
    assert [cluster.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    with pytest.raises(ClusterError, match=r"rank=16: must be an integer in \[0, 16\)"):
        cluster.node_of(16)
    with pytest.raises(ClusterError, match="group_size=0"):
        cluster.group_spans_nodes(0)
    with pytest.raises(ClusterError, match="stride=0"):
        cluster.link_for(2, 0)
    with pytest.raises(ClusterError, match="= 6 does not divide the world size 16"):
        cluster.group_spans_nodes(3, 2)


def test_peak_flops_unknown_dtype_lists_known():
    with pytest.raises(ClusterError) as err:
        Cluster.preset("a100-80gb").peak_flops("fp8")
    assert "'fp8'" in str(err.value) and "'bf16'" in str(err.value) and "device.peak_flops" in str(err.value)


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_covers_planning_fields_only():
    base = Cluster.parse("h100-sxm:2x8")
    fp = base.fingerprint()
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 16
    assert dataclasses.replace(base, name="other").fingerprint() == fp
    assert dataclasses.replace(base, device=dataclasses.replace(base.device, name="x")).fingerprint() == fp
    assert Cluster.parse("h100-sxm:4x8").fingerprint() != fp
    assert dataclasses.replace(base, inter_node=LinkSpec(25e9, 1e-5)).fingerprint() != fp
    # int and float spellings of one value give one fingerprint
    assert dataclasses.replace(base, host_bandwidth=50_000_000_000).fingerprint() == fp


# ---------------------------------------------------------------- units


@pytest.mark.parametrize(
    "value,kind,expected",
    [
        ("80GB", "bytes", 80e9), ("80 GiB", "bytes", 80 * 2**30), ("512B", "bytes", 512), (1024, "bytes", 1024),
        ("900GB/s", "bytes/s", 900e9), ("400Gb/s", "bytes/s", 50e9), ("1.5TB/s", "bytes/s", 1.5e12),
        ("10us", "seconds", 1e-5), ("5 µs", "seconds", 5e-6), ("2ms", "seconds", 2e-3), ("1s", "seconds", 1.0),
        ("989TFLOP/s", "flop/s", 989e12), ("67 TFLOPS", "flop/s", 67e12), ("25e9", "bytes/s", 25e9),
        ("1_000", "number", 1000), (0.5, "number", 0.5),
    ],
)
def test_parse_quantity(value, kind, expected):
    assert cluster_io.parse_quantity(value, kind, "f") == pytest.approx(expected)


@pytest.mark.parametrize(
    "value,kind",
    [("10 parsecs", "seconds"), ("10us", "bytes/s"), ("80gb", "bytes"), ("inf", "number"), ("nan", "bytes"),
     (True, "number"), (None, "bytes"), ("-5GB", "bytes"), (math.inf, "number"), ("GB", "bytes"), ("5%", "number")],
)
def test_parse_quantity_is_strict(value, kind):
    with pytest.raises(ClusterError) as err:
        cluster_io.parse_quantity(value, kind, "device.x")
    assert f"device.x={value!r}" in str(err.value)


# ---------------------------------------------------------------- files


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_file_overrides_a_preset_with_units(tmp_path):
    path = _write(tmp_path, "c.yaml", (
        "preset: h100-sxm\nnodes: 4\n"
        "inter_node: {bandwidth: 25e9}\n"          # YAML 1.1 reads 25e9 as a string
        "intra_node: {latency: 7us}\n"
        "device: {memory_bytes: 64GiB, peak_flops: {bf16: 900TFLOP/s}}\n"
    ))
    cluster = Cluster.from_file(path)
    preset = Cluster.preset("h100-sxm", nodes=4)
    assert cluster.name == "h100-sxm:4x8" and cluster.world_size == 32
    assert cluster.inter_node == LinkSpec(25e9, preset.inter_node.latency, preset.inter_node.name)
    assert cluster.intra_node.latency == pytest.approx(7e-6)
    assert cluster.intra_node.bandwidth == preset.intra_node.bandwidth
    assert cluster.device.memory_bytes == 64 * 2**30
    assert cluster.peak_flops("bf16") == 900e12 and cluster.peak_flops("fp8") == preset.peak_flops("fp8")


def test_full_json_file_and_content_sniffing(tmp_path):
    cluster = Cluster.parse("a100-80gb:2x8")
    text = json.dumps(cluster.to_dict())
    assert Cluster.from_file(_write(tmp_path, "c.json", text)) == cluster
    assert Cluster.from_file(_write(tmp_path, "c.cluster", text)) == cluster  # no extension: sniffed JSON
    assert Cluster.from_file(_write(tmp_path, "d.cluster", "preset: cpu\ndevices_per_node: 2\n")).world_size == 2
    assert Cluster.load(str(tmp_path / "c.json")) == cluster
    assert Cluster.load(tmp_path / "d.cluster").name == "cpu:1x2"
    renamed = Cluster.from_file(_write(tmp_path, "e.cluster", "preset: cpu\nname: mybox\ndevices_per_node: 2\n"))
    assert renamed.name == "mybox" and renamed.runs_on_cpu  # CPU ranks by their device, not their name
    assert not Cluster.from_file(_write(tmp_path, "f.cluster", "preset: h100-sxm\nname: cpu-less\n")).runs_on_cpu
    assert Cluster.load("h100-sxm:2x8") == Cluster.parse("h100-sxm:2x8")


@pytest.mark.parametrize(
    "text,needles",
    [
        ("preset: h100-sxm\nnodez: 2\n", ["unknown key(s) ['nodez']", "'nodes'", "'inter_node'"]),
        ("preset: h100-sxm\ninter_node: {bandwith: 1e9}\n", ["inter_node", "['bandwith']", "'bandwidth'"]),
        ("preset: h100-sxm\ndevice: {peak_flops: {fp64: 1e12}}\n", ["device.peak_flops", "['fp64']", "'bf16'"]),
        ("preset: h100-sxm\nnodes: 0\n", ["Cluster.nodes=0"]),
        ("preset: h100-sxm\nnodes: -2\n", ["Cluster.nodes=-2"]),
        ("preset: h100-sxm\nintra_node: {bandwidth: 0}\n", ["LinkSpec.bandwidth=0"]),
        ("preset: h100-sxm\nintra_node: {latency: 10 parsecs}\n", ["intra_node.latency='10 parsecs'"]),
        ("preset: h100-sxm\nhost_memory_bytes: 80gb\n", ["host_memory_bytes='80gb'", "'GiB'"]),
        ("preset: h100-sxm\nnodes: two\n", ["nodes='two'", "integer"]),
        ("preset: tpu\n", ["unknown cluster preset 'tpu'", "h100-sxm"]),
        ("name: x\nnodes: 1\n", ["missing key(s) ['devices_per_node', 'device'", "preset: NAME"]),
        ("- preset: cpu\n", ["expected a mapping at the top level, got list"]),
        ("name: x\nnodes: 1\ndevices_per_node: 1\ndevice: {name: d}\nintra_node: {}\ninter_node: {}\n"
         "host_bandwidth: 1e9\n", ["device: missing key(s) ['memory_bytes', 'peak_flops', 'hbm_bandwidth']"]),
    ],
)
def test_bad_files_name_the_file_and_the_problem(tmp_path, text, needles):
    path = _write(tmp_path, "bad.yaml", text)
    with pytest.raises(ClusterError) as err:
        Cluster.from_file(path)
    assert str(path) in str(err.value)
    for needle in needles:
        assert needle in str(err.value)


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(ClusterError, match="does not exist") as err:
        Cluster.load(str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in str(err.value)
    with pytest.raises(ClusterError, match=r"bad\.yaml'?: invalid YAML: .*line 2"):
        Cluster.from_file(_write(tmp_path, "bad.yaml", "preset: cpu\nnodes: [1, 2\n"))
    with pytest.raises(ClusterError, match=r"bad\.json'?: invalid JSON: Expecting .*line 1 column"):
        Cluster.from_file(_write(tmp_path, "bad.json", '{"preset": "cpu",}'))


# ---------------------------------------------------------------- calibration


def test_with_calibration_applies_and_records(tmp_path):
    base = Cluster.parse("h100-sxm:2x8")
    measured = {"device": "NVIDIA H100 80GB HBM3", "date": "2025-01-31", "matmul_efficiency": 0.79,
                "intra_node": {"bandwidth": "360GB/s", "latency": 6e-6}, "inter_node": {"bandwidth": 45e9}}
    calibrated = base.with_calibration(measured)
    assert calibrated.device.matmul_efficiency == 0.79
    assert calibrated.intra_node == LinkSpec(360e9, 6e-6, base.intra_node.name)
    assert calibrated.inter_node == LinkSpec(45e9, base.inter_node.latency, base.inter_node.name)
    assert calibrated.calibration == {
        "date": "2025-01-31", "device": "NVIDIA H100 80GB HBM3", "matmul_efficiency": 0.79,
        "intra_node.bandwidth": 360e9, "intra_node.latency": 6e-6, "inter_node.bandwidth": 45e9,
    }
    assert calibrated.fingerprint() != base.fingerprint()
    assert Cluster.from_dict(json.loads(json.dumps(calibrated.to_dict()))) == calibrated
    path = _write(tmp_path, "cal.json", json.dumps(measured))
    assert base.with_calibration(path) == calibrated


@pytest.mark.parametrize(
    "measured,needle",
    [
        ({"matmul_eff": 0.7}, "unknown key(s) ['matmul_eff']"),
        ({"intra_node": {"bw": 1e9}}, "calibration.intra_node: unknown key(s) ['bw']"),
        ({"matmul_efficiency": 1.3}, "DeviceSpec.matmul_efficiency=1.3"),
        ({"device": "NVIDIA A100-SXM4-80GB", "matmul_efficiency": 0.7}, "(preset a100-80gb) does not fit"),
    ],
)
def test_bad_calibration(measured, needle):
    with pytest.raises(ClusterError) as err:
        Cluster.parse("h100-sxm").with_calibration(measured)
    assert needle in str(err.value)


# ---------------------------------------------------------------- describe


def test_describe_renders_the_summary():
    from rich.console import Console

    cluster = Cluster.parse("h100-sxm:2x8").with_calibration({"matmul_efficiency": 0.77})
    console = Console(record=True, width=160)
    console.print(cluster.describe())
    text = console.export_text()
    for needle in ("16 = 2 node(s) × 8 device(s)", "H100 SXM 80GB", "79.2 GiB", "bf16 989 TFLOP/s", "0.77",
                   "370 GB/s", "46 GB/s", "3.35 TB/s", cluster.fingerprint(), "calibrated on", "matmul efficiency"):
        assert needle in text, needle


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize(
    "topology,kind", [(TOPO_2X_NVLINK, "nvlink"), (TOPO_4X_PCIE, "pcie"), (TOPO_1X, None), (None, None), ("", None)]
)
def test_link_kind_reads_nvidia_smi_topology(topology, kind):
    assert cluster_detect.link_kind(topology) == kind


def test_detect_gpus(monkeypatch):
    monkeypatch.setattr(cluster_detect, "_cuda_device", lambda: (2, "NVIDIA H200", 150_109_880_320))
    monkeypatch.setattr(cluster_detect, "_nvidia_smi_topology", lambda: TOPO_2X_NVLINK)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cluster = Cluster.detect()
    preset = Cluster.preset("h200")
    assert (cluster.nodes, cluster.devices_per_node, cluster.device.name) == (1, 2, "NVIDIA H200")
    assert cluster.device.peak_flops == preset.device.peak_flops and cluster.intra_node == preset.intra_node
    assert cluster.host_memory_bytes == cluster_detect.host_memory_bytes() > 0
    assert Cluster.detect(nodes=3).world_size == 6

    monkeypatch.setattr(cluster_detect, "_cuda_device", lambda: (4, "NVIDIA H100 80GB HBM3", 85_017_493_504))
    monkeypatch.setattr(cluster_detect, "_nvidia_smi_topology", lambda: TOPO_4X_PCIE)
    pcie = Cluster.detect()
    assert pcie.intra_node.name == "pcie" and pcie.intra_node.bandwidth < pcie.host_bandwidth
    assert pcie.peak_flops("bf16") == 989e12

    monkeypatch.setattr(cluster_detect, "_cuda_device", lambda: (1, "NVIDIA GeForce RTX 4090", 24 * 2**30))
    with pytest.raises(ClusterError, match="'NVIDIA GeForce RTX 4090' matches no preset"):
        Cluster.detect()


def test_detect_cpu(monkeypatch):
    monkeypatch.setattr(cluster_detect, "_cuda_device", lambda: None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cluster = Cluster.detect()
    ram = cluster_detect.host_memory_bytes()
    assert (cluster.nodes, cluster.devices_per_node) == (2, 2)
    assert cluster.device.memory_bytes == ram // 2 and cluster.host_memory_bytes == ram
    data = cluster_detect.cpu_dict(nodes=1, cores=16, ram_bytes=64 * 2**30, local_ranks=4, cpu_name="Xeon")
    big = Cluster.from_dict(data)
    assert big.peak_flops("fp32") == 4 * Cluster.preset("cpu").peak_flops("fp32")
    assert big.device.memory_bytes == 16 * 2**30 and big.device.name == "Xeon (4 core(s)/rank)"


@pytest.mark.parametrize(
    "env,nodes",
    [({}, 1), ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2), ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, 1),
     ({"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "8"}, 1)],
)
def test_nodes_from_env(env, nodes):
    assert cluster_detect.nodes_from_env(env) == nodes


def test_match_device_name():
    names = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H200": "h200",
             "NVIDIA A100-SXM4-80GB": "a100-80gb", "Tesla V100-SXM2-32GB": None}
    assert {n: cluster_presets.match_device_name(n) for n in names} == names
