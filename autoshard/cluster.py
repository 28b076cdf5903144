"""``Cluster``: nodes × devices, each device's speeds, and the links between them.

PLACEHOLDER: presets, parsing (``PRESET:NODESxDEVICES``), ``from_file``,
``detect`` and validation are completed by the Foundation issue; the field
layout below is the contract the cost model reads.

Units: bytes, seconds, FLOP/s, bytes/s. Link bandwidth is per device, one
direction (what a ring collective's step moves per link).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU socket share)."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]  # dtype ("fp32", "bf16", "fp8") → FLOP/s, dense
    hbm_bandwidth: float  # bytes/s
    matmul_efficiency: float = 0.8  # achieved / peak for large GEMMs (calibratable)


@dataclass(frozen=True)
class LinkSpec:
    """One link level: bandwidth per device per direction and per-message latency."""

    bandwidth: float  # bytes/s
    latency: float  # seconds


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster of ``nodes`` × ``devices_per_node`` devices."""

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    host_bandwidth: float  # host↔device bytes/s per device (PCIe)
    host_memory_bytes: int = 0  # per node
    cpu_adam_params_per_s: float = 1.0e9  # CPU Adam update rate per device share (ZeRO-Offload)
    calibration: dict[str, float] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node
