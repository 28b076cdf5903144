"""Cluster presets: published and measured figures, in the ``Cluster.to_dict`` schema.

Each preset describes ONE node type; ``Cluster.preset(name, nodes, devices_per_node)``
sets the count. Sources (see /work/shared/REFERENCES.md):

Devices (dense, no sparsity):

| preset | bf16 / fp16 | fp8 / int8 | tf32 | fp32 (no tf32) | HBM | memory |
| --- | --- | --- | --- | --- | --- | --- |
| ``h100-sxm`` | 989 TFLOP/s | 1979 | 494.7 | 66.9 | 3.35 TB/s | 80 GiB HBM3 |
| ``h200`` | 989 | 1979 | 494.7 | 66.9 | 4.8 TB/s | 141 GB HBM3e |
| ``a100-80gb`` | 312 | — / 624 | 156 | 19.5 | 2.04 TB/s | 80 GiB HBM2e |
| ``h100-pcie`` | 756 | 1513 | 378 | 51.2 | 2.0 TB/s | 80 GiB HBM2e |

``memory_bytes`` is what the CUDA driver reports as total memory
(``torch.cuda.get_device_properties().total_memory``), a little under the
marketed size: read on this project's machines as 85,017,493,504 for "NVIDIA
H100 80GB HBM3" (nvidia-smi: 81559 MiB) and 150,109,880,320 for "NVIDIA H200"
(143771 MiB); A100 80GB: 85,198,045,184 as commonly reported; H100 PCIe taken
equal to H100 SXM. The cost model subtracts its own allocator headroom.

``matmul_efficiency`` (achieved / peak for a large bf16 GEMM): 8192³ bf16 reaches
≈ 790 TFLOP/s on H200 and 780–800 on H100 SXM, so 0.8; A100 is taken at the same
fraction. H100 PCIe (350 W) clocks lower under load: 0.75. ``hbm_efficiency``
(device copy, bytes read + written / peak): H200 4.16/4.8 ≈ 0.87, H100 3.0/3.35 ≈
0.9; A100 and H100 PCIe assumed 0.85. ``autoshard cluster calibrate`` replaces
both with measurements (``Cluster.with_calibration``).

Links. ``bandwidth`` is per device, per direction, what one step of a ring
collective achieves: the NCCL *bus bandwidth*
(all-reduce algbw·2(n−1)/n), not the marketed bidirectional total.

- intra-node NVLink: 8×H100 ring bus bandwidth ≈ 370 GB/s (of 450 GB/s per
  direction; NVLS all-reduce reaches ≈ 480 but is not what a ring gets); H200
  has the same NVLink 4 (370); 8×A100 ≈ 230 GB/s (of 300 per direction).
  Latency α = 5 µs per ring step (NCCL's own model: a base of ~6–8 µs per
  collective plus ~0.6–1 µs per NVLink hop; a step of a large ring costs less,
  a small collective more, and calibration measures it).
- intra-node PCIe (``h100-pcie``, no NVLink bridges): Gen5 x16 is ~50 GB/s per
  direction to the host; a ring through PCIe switches shares uplinks, so 40 GB/s
  and α = 10 µs.
- inter-node InfiniBand: one NIC per GPU (the DGX/HGX layout; NCCL runs one
  ring per NIC, so a cross-node ring gets one NIC's bandwidth per device).
  NDR 400 Gb/s ≈ 46 GB/s measured per NIC (H100, H200); the A100 generation
  ships HDR 200 Gb/s ≈ 23 GB/s. α = 10 µs (NIC + switch + proxy). PCIe servers
  (``h100-pcie``) usually carry one NIC per PCIe switch, i.e. per two GPUs, and
  the NIC traffic shares that switch: 46/2 = 23 GB/s per device.
  A cluster with fewer NICs per node overrides ``inter_node.bandwidth`` in a file.
- host ↔ device (ZeRO-Offload copies): PCIe Gen5 ≈ 50 GB/s per direction
  (H100, H200), Gen4 ≈ 25 GB/s (A100).
- host memory per node: DGX reference configurations (2 TB for DGX H100/H200,
  1 TB for DGX A100); ``cpu_adam_params_per_s`` 1e9 parameters/s per GPU's share
  of the host CPUs (DeepSpeed CPU-Adam order of magnitude).

``cpu``: one *device* is one rank of a local CPU run (``cpu:1x2`` = two gloo
processes on one host), each with ONE core (workers run with OMP_NUM_THREADS=1).
Figures measured on the 2-core AVX-512 machine CI uses: 1-thread matmul ≈ 94
GFLOP/s fp32 and ≈ 216 bf16 (AVX512-BF16), copy ≈ 34 GB/s; gloo all-reduce over
loopback ≈ 0.8 GB/s bus bandwidth with ≈ 100 µs per message. Memory per rank
is a 4 GiB share of host RAM; the host link is a memcpy. Inter-node figures
assume gloo over 10 GbE TCP (1.25 GB/s raw; gloo's own overhead, seen on
loopback, makes 0.5 GB/s a fair guess). ``Cluster.detect()`` on a CPU host uses the real core count
and RAM instead.
"""

from __future__ import annotations

from typing import Any

from autoshard.errors import ClusterError

GiB = 2**30
TiB = 2**40

_HOPPER_FLOPS = {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "int8": 1979e12}
_NVLINK4 = {"name": "nvlink4", "bandwidth": 370e9, "latency": 5e-6}
_IB_NDR = {"name": "ib-ndr-400", "bandwidth": 46e9, "latency": 10e-6}

PRESETS: dict[str, dict[str, Any]] = {
    "h100-sxm": {
        "devices_per_node": 8,
        "device": {
            "name": "H100 SXM 80GB",
            "memory_bytes": 85_017_493_504,
            "peak_flops": dict(_HOPPER_FLOPS),
            "hbm_bandwidth": 3.35e12,
            "matmul_efficiency": 0.8,
            "hbm_efficiency": 0.9,
        },
        "intra_node": dict(_NVLINK4),
        "inter_node": dict(_IB_NDR),
        "host_bandwidth": 50e9,
        "host_memory_bytes": 2 * TiB,
        "cpu_adam_params_per_s": 1e9,
    },
    "h200": {
        "devices_per_node": 8,
        "device": {
            "name": "H200 141GB",
            "memory_bytes": 150_109_880_320,
            "peak_flops": dict(_HOPPER_FLOPS),
            "hbm_bandwidth": 4.8e12,
            "matmul_efficiency": 0.8,
            "hbm_efficiency": 0.87,
        },
        "intra_node": dict(_NVLINK4),
        "inter_node": dict(_IB_NDR),
        "host_bandwidth": 50e9,
        "host_memory_bytes": 2 * TiB,
        "cpu_adam_params_per_s": 1e9,
    },
    "a100-80gb": {
        "devices_per_node": 8,
        "device": {
            "name": "A100 SXM 80GB",
            "memory_bytes": 85_198_045_184,
            "peak_flops": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12, "int8": 624e12},
            "hbm_bandwidth": 2.039e12,
            "matmul_efficiency": 0.8,
            "hbm_efficiency": 0.85,
        },
        "intra_node": {"name": "nvlink3", "bandwidth": 230e9, "latency": 5e-6},
        "inter_node": {"name": "ib-hdr-200", "bandwidth": 23e9, "latency": 10e-6},
        "host_bandwidth": 25e9,
        "host_memory_bytes": 1 * TiB,
        "cpu_adam_params_per_s": 1e9,
    },
    "h100-pcie": {
        "devices_per_node": 8,
        "device": {
            "name": "H100 PCIe 80GB",
            "memory_bytes": 85_017_493_504,
            "peak_flops": {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12, "fp8": 1513e12,
                           "int8": 1513e12},
            "hbm_bandwidth": 2.0e12,
            "matmul_efficiency": 0.75,
            "hbm_efficiency": 0.85,
        },
        "intra_node": {"name": "pcie5", "bandwidth": 40e9, "latency": 10e-6},
        "inter_node": {"name": "ib-ndr-400-shared", "bandwidth": 23e9, "latency": 10e-6},
        "host_bandwidth": 50e9,
        "host_memory_bytes": 1 * TiB,
        "cpu_adam_params_per_s": 1e9,
    },
    "cpu": {
        "devices_per_node": 1,
        "device": {
            "name": "CPU core",
            "memory_bytes": 4 * GiB,
            "peak_flops": {"fp32": 125e9, "bf16": 250e9},
            "hbm_bandwidth": 40e9,
            "matmul_efficiency": 0.75,
            "hbm_efficiency": 0.85,
        },
        "intra_node": {"name": "gloo-loopback", "bandwidth": 0.8e9, "latency": 100e-6},
        "inter_node": {"name": "gloo-10gbe", "bandwidth": 0.5e9, "latency": 150e-6},
        "host_bandwidth": 20e9,
        "host_memory_bytes": 16 * GiB,
        "cpu_adam_params_per_s": 2e8,
    },
}

ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "h200-sxm": "h200"}

# Substrings of a device name (lower-cased, as CUDA reports it: "NVIDIA H100 80GB HBM3",
# "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-80GB") → preset. First match wins.
_NAME_PATTERNS = (
    (("h200",), "h200"),
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-sxm"),
    (("a100",), "a100-80gb"),
)


def preset_names() -> list[str]:
    """Sorted preset names (aliases excluded)."""
    return sorted(PRESETS)


def resolve(name: str) -> str | None:
    """The canonical preset name for ``name`` (case-insensitive, aliases allowed), or ``None``."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in PRESETS else None


def match_device_name(device_name: str) -> str | None:
    """The preset whose device best matches a reported device name, or ``None``.

    >>> match_device_name("NVIDIA H100 80GB HBM3")
    'h100-sxm'
    """
    lowered = device_name.lower()
    for needles, preset in _NAME_PATTERNS:
        if all(needle in lowered for needle in needles):
            return preset
    return None


# How a CPU rank's device is named: the ``cpu`` preset's device, or ``cluster_detect.cpu_dict``'s
# "MODEL NAME (N core(s)/rank)" for a detected CPU host.
_CPU_DEVICE_NAME = PRESETS["cpu"]["device"]["name"]
_DETECTED_CPU_SUFFIX = " core(s)/rank)"


def device_kind(device_name: str) -> str | None:
    """``"gpu"`` for a device name of a GPU preset (``match_device_name``), ``"cpu"`` for a CPU rank's
    (the ``cpu`` preset's, or a detected CPU host's), ``None`` when the name tells neither."""
    if match_device_name(device_name) is not None:
        return "gpu"
    if device_name == _CPU_DEVICE_NAME or device_name.endswith(_DETECTED_CPU_SUFFIX):
        return "cpu"
    return None


def check_same_hardware(measured_device: str, cluster_device: str) -> None:
    """Refuse calibration measured on other hardware than the cluster's device: a GPU of another preset,
    or a GPU for CPU ranks and the reverse (``device_kind``).

    Names that tell neither (or an empty name) are accepted: there is
    nothing to compare them with.
    """
    measured_kind, expected_kind = device_kind(measured_device), device_kind(cluster_device)
    if measured_kind is not None and expected_kind is not None and measured_kind != expected_kind:
        raise ClusterError(
            f"calibration measured on {measured_device!r} (a {measured_kind.upper()}) does not fit this cluster's "
            f"device {cluster_device!r} (a {expected_kind.upper()}); calibrate on the cluster's hardware "
            f"(`autoshard cluster calibrate` there), or apply it to a {measured_kind.upper()} cluster"
        )
    measured, expected = match_device_name(measured_device), match_device_name(cluster_device)
    if measured is not None and expected is not None and measured != expected:
        raise ClusterError(
            f"calibration measured on {measured_device!r} (preset {measured}) does not fit this cluster's "
            f"device {cluster_device!r} (preset {expected}); calibrate on the cluster's hardware, or use a "
            f"'{measured}' cluster"
        )
