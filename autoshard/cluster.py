"""``Cluster``: nodes × devices, each device's speeds, and the links between them.

A cluster is homogeneous: ``nodes`` identical nodes of ``devices_per_node``
devices. Ranks are laid out node-major (rank ``r`` lives on node
``r // devices_per_node``), which is what torchrun gives with one process per
device. Communication has two levels, each an α-β ``LinkSpec``: sending ``M``
bytes in one step costs ``latency + M / bandwidth``. A group of ranks that lies
inside one node pays ``intra_node``; a group that crosses a node boundary pays
``inter_node`` (the slowest level it crosses; ``link_for``).

Units: bytes, seconds, FLOP/s, bytes/s. Link bandwidth is per device, one
direction (what a ring collective's step moves per link: NCCL's bus bandwidth).
Presets and their sources: ``autoshard/cluster_presets.py``; strings and files:
``autoshard/cluster_io.py``; hardware probing: ``autoshard/cluster_detect.py``.

Front doors, all returning a validated ``Cluster``:

- ``Cluster.preset("h100-sxm", nodes=4)``; ``Cluster.parse("h100-sxm:4x8")``;
- ``Cluster.from_file("cluster.yaml")`` / ``Cluster.from_dict(d)`` (schema in
  ``from_dict``); ``Cluster.load(spec)`` picks file or preset string;
- ``Cluster.detect()`` probes this machine;
- ``cluster.with_calibration(measured)`` applies ``autoshard cluster calibrate``
  output (format in ``with_calibration``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard import cluster_io, cluster_presets, file_io
from autoshard.cluster_io import CALIBRATION_KEYS, CLUSTER_KINDS, DEVICE_KINDS, LINK_KINDS
from autoshard.errors import ClusterError

log = logging.getLogger(__name__)

DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")
REQUIRED_DTYPES = ("fp32", "bf16")  # the training precisions (TrainSpec.precision)

# Measured cost-model constants kept in ``Cluster.calibration`` as they are (search/layer_terms.py reads them).
_COST_MODEL_KEYS = ("attention_efficiency", "overlap_contention", "overlap_efficiency", "kernel_overhead_s", "gemm_knee_flops", "adamw_s_per_param", "adamw_s_per_tensor",
                    "graph_kernel_s", "graph_compiled_kernel_s", "graph_collective_s", "eager_kernel_s",
                    "eager_inference_kernel_s")
_LAYER_TIMES_KEYS = ("model", "dtype", "seq_len", "samples")
COMPILED_SAVED_SCALE_KEY = "layer_times.compiled_saved_scale"  # flat calibration key (search/cost_model.predict)
LAYER_TIME_KEY_PREFIX = "layer_time"  # flat calibration keys of the probed layer times (layer_time_key)
# compiled: true when scaled to the compiled step (calibrate --compile), with the factors in
# compiled_scales (a record; the samples already carry them); compiled_saved_scale: the compiled
# runtime's block-activation scale (calibrate_probe.compiled_saved_scale)
_LAYER_TIMES_OPTIONAL = ("compiled", "compiled_scales", "compiled_saved_scale")
_LAYER_SAMPLE_KEYS = ("signature", "layer", "tp", "tokens", "fwd_s", "bwd_s")
# Range of each cost-model constant of a calibration file, (low, high, low is allowed): what calibrate.py can
# measure; a value outside (a negative overhead, an efficiency of 3) is a damaged file, not a measurement.
_COST_MODEL_RANGES = {
    "attention_efficiency": (0.0, 1.0, False), "overlap_efficiency": (0.0, 1.0, False),
    "overlap_contention": (0.0, 1.0, True), "kernel_overhead_s": (0.0, math.inf, True),
    "gemm_knee_flops": (0.0, math.inf, True), "adamw_s_per_param": (0.0, math.inf, True),
    "adamw_s_per_tensor": (0.0, math.inf, True), "graph_kernel_s": (0.0, math.inf, True),
    "graph_compiled_kernel_s": (0.0, math.inf, True),
    "graph_collective_s": (0.0, math.inf, True),
    "eager_kernel_s": (0.0, math.inf, True), "eager_inference_kernel_s": (0.0, math.inf, True),
}


_FIX_CLUSTER = "fix the value (in the cluster file, or override the preset's)"
_FIX_CALIBRATION = "fix the value in the calibration file, or calibrate again"


def _fail(where: str, value: Any, allowed: str) -> ClusterError:
    return ClusterError(f"{where}={value!r}: {allowed}; {_FIX_CLUSTER}")


def _positive(where: str, value: Any, *, integer: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value <= 0:
        raise _fail(where, value, "must be a positive " + ("integer" if integer else "finite number"))


def _fraction(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _fail(where, value, "must be in (0, 1] (achieved / peak)")


def _name(where: str, value: Any, *, allow_empty: bool = False) -> None:
    if not isinstance(value, str) or (not value.strip() and not allow_empty):
        raise _fail(where, value, "must be a non-empty string")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or, for the ``cpu`` preset, one rank's share of a CPU host).

    name: what the hardware reports or the preset calls it (not used by planning).
    memory_bytes: device memory the driver reports as total (the cost model
        subtracts allocator headroom).
    peak_flops: dtype → dense peak FLOP/s; keys from ``DTYPES``, must include
        ``fp32`` and ``bf16``.
    hbm_bandwidth: peak device-memory bandwidth, bytes/s.
    matmul_efficiency: achieved / peak for large GEMMs, in (0, 1] (calibratable).
    hbm_efficiency: achieved / peak device-memory bandwidth of a copy, in (0, 1].
    """

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]  # dtype ("fp32", "bf16", "fp8") → FLOP/s, dense
    hbm_bandwidth: float  # bytes/s
    matmul_efficiency: float = 0.8  # achieved / peak for large GEMMs (calibratable)
    hbm_efficiency: float = 0.85  # achieved / peak for a device copy (calibratable)

    def __post_init__(self) -> None:
        _name("DeviceSpec.name", self.name)
        _positive("DeviceSpec.memory_bytes", self.memory_bytes, integer=True)
        self._check_peak_flops()
        _positive("DeviceSpec.hbm_bandwidth", self.hbm_bandwidth)
        _fraction("DeviceSpec.matmul_efficiency", self.matmul_efficiency)
        _fraction("DeviceSpec.hbm_efficiency", self.hbm_efficiency)
        # Own copies, floats normalised: equal values give equal dicts and fingerprints.
        object.__setattr__(self, "peak_flops", {k: float(v) for k, v in sorted(self.peak_flops.items())})
        for name in ("hbm_bandwidth", "matmul_efficiency", "hbm_efficiency"):
            object.__setattr__(self, name, float(getattr(self, name)))

    def _check_peak_flops(self) -> None:
        if not isinstance(self.peak_flops, Mapping):
            raise _fail("DeviceSpec.peak_flops", self.peak_flops, f"must map dtypes {list(DTYPES)} to FLOP/s")
        for dtype, flops in self.peak_flops.items():
            if dtype not in DTYPES:
                raise _fail("DeviceSpec.peak_flops", dtype, f"unknown dtype key; allowed: {list(DTYPES)}")
            _positive(f"DeviceSpec.peak_flops[{dtype!r}]", flops)
        missing = [d for d in REQUIRED_DTYPES if d not in self.peak_flops]
        if missing:
            raise _fail("DeviceSpec.peak_flops", dict(self.peak_flops), f"missing dtype(s) {missing}")

    def __hash__(self) -> int:
        return hash((self.name, self.memory_bytes, tuple(self.peak_flops.items()), self.hbm_bandwidth,
                     self.matmul_efficiency, self.hbm_efficiency))

    @property
    def achieved_hbm_bandwidth(self) -> float:
        """``hbm_bandwidth * hbm_efficiency``: bytes/s a memory-bound kernel gets."""
        return self.hbm_bandwidth * self.hbm_efficiency


@dataclass(frozen=True)
class LinkSpec:
    """One link level: bandwidth per device per direction and per-message latency.

    Sending ``M`` bytes in one step costs ``latency + M / bandwidth`` (α-β).
    ``bandwidth`` is what one ring step achieves (NCCL bus bandwidth), bytes/s;
    ``latency`` is α, seconds per message (≥ 0); ``name`` is descriptive only.
    """

    bandwidth: float  # bytes/s
    latency: float  # seconds
    name: str = ""

    def __post_init__(self) -> None:
        _positive("LinkSpec.bandwidth", self.bandwidth)
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)) or not (
            math.isfinite(self.latency) and self.latency >= 0
        ):
            raise _fail("LinkSpec.latency", self.latency, "must be a finite number of seconds ≥ 0")
        _name("LinkSpec.name", self.name, allow_empty=True)
        object.__setattr__(self, "bandwidth", float(self.bandwidth))
        object.__setattr__(self, "latency", float(self.latency))

    def time(self, num_bytes: float) -> float:
        """α + M/β: seconds to send ``num_bytes`` over this link in one message."""
        return self.latency + num_bytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster of ``nodes`` × ``devices_per_node`` devices.

    name: a label (``"h100-sxm:4x8"``); not used by planning.
    nodes, devices_per_node: integers ≥ 1; ranks are node-major.
    device: every device's ``DeviceSpec``.
    intra_node / inter_node: the two ``LinkSpec`` levels (see module docstring).
    host_bandwidth: host↔device bytes/s per device, one direction (PCIe).
    host_memory_bytes: host RAM per node; 0 means not known.
    cpu_adam_params_per_s: parameters/s one device's share of the host CPUs
        updates with Adam (ZeRO-Offload).
    calibration: what ``with_calibration`` applied (flat keys such as
        ``"intra_node.bandwidth"``, plus ``"device"`` and ``"date"``); a record,
        the applied values already live in ``device`` and the links.

    Validated on construction: a bad field raises ``ClusterError`` naming the
    field, the value and what is allowed.
    """

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    host_bandwidth: float  # host↔device bytes/s per device (PCIe)
    host_memory_bytes: int = 0  # per node
    cpu_adam_params_per_s: float = 1.0e9  # CPU Adam update rate per device share (ZeRO-Offload)
    calibration: dict[str, float | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _name("Cluster.name", self.name)
        _positive("Cluster.nodes", self.nodes, integer=True)
        _positive("Cluster.devices_per_node", self.devices_per_node, integer=True)
        if self.nodes * self.devices_per_node > file_io.MAX_WORLD_SIZE:
            raise _fail("Cluster.nodes", self.nodes, f"nodes × devices_per_node = {self.nodes} × "
                        f"{self.devices_per_node} is more than {file_io.MAX_WORLD_SIZE} (2**20) ranks")
        for name, cls in (("device", DeviceSpec), ("intra_node", LinkSpec), ("inter_node", LinkSpec)):
            if not isinstance(getattr(self, name), cls):
                raise _fail(f"Cluster.{name}", getattr(self, name), f"must be a {cls.__name__}")
        _positive("Cluster.host_bandwidth", self.host_bandwidth)
        if isinstance(self.host_memory_bytes, bool) or not isinstance(self.host_memory_bytes, int) or (
            self.host_memory_bytes < 0
        ):
            raise _fail("Cluster.host_memory_bytes", self.host_memory_bytes, "must be an integer ≥ 0 (0: unknown)")
        _positive("Cluster.cpu_adam_params_per_s", self.cpu_adam_params_per_s)
        if not isinstance(self.calibration, Mapping):
            raise _fail("Cluster.calibration", self.calibration, "must be a mapping")
        object.__setattr__(self, "calibration", dict(sorted(self.calibration.items())))
        object.__setattr__(self, "host_bandwidth", float(self.host_bandwidth))
        object.__setattr__(self, "cpu_adam_params_per_s", float(self.cpu_adam_params_per_s))

    def __hash__(self) -> int:
        return hash((self.name, self.nodes, self.devices_per_node, self.device, self.intra_node, self.inter_node,
                     self.host_bandwidth, self.host_memory_bytes, self.cpu_adam_params_per_s,
                     tuple(self.calibration.items())))

    # ------------------------------------------------------------------ queries

    @property
    def runs_on_cpu(self) -> bool:
        """Whether the ranks are CPU processes (the ``cpu`` preset, or a detected CPU host, whatever the
        cluster is named: its device says so, ``cluster_presets.device_kind``): the runtime then runs plans
        eager, and the cost model prices no compiled graph (``search/layer_terms.py``)."""
        if self.name.split(":")[0] == "cpu" or self.name.startswith("detected:cpu:"):
            return True
        return cluster_presets.device_kind(self.device.name) == "cpu"

    @property
    def world_size(self) -> int:
        """Number of devices (ranks): ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        """The node holding ``rank`` (node-major layout)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ClusterError(f"rank={rank!r}: must be an integer in [0, {self.world_size}) for {self.name}")
        return rank // self.devices_per_node

    def group_spans_nodes(self, group_size: int, stride: int = 1) -> bool:
        """Whether groups of ``group_size`` ranks ``stride`` apart cross a node boundary.

        The groups are those of one mesh axis in a row-major mesh: the axis of
        size ``group_size`` whose neighbours are ``stride`` ranks apart splits
        the ranks into groups ``{b + i*stride : 0 ≤ i < group_size}``. True if
        any of them holds ranks on two nodes. ``group_size * stride`` must
        divide the world size.
        """
        self._check_group(group_size, stride)
        extent = (group_size - 1) * stride  # distance from first to last rank of a group
        if extent == 0:
            return False
        if extent >= self.devices_per_node:
            return True
        block = group_size * stride  # bases are b = j*block + k, 0 ≤ k < stride
        period = math.lcm(block, self.devices_per_node)  # base positions mod node repeat after this
        return any(
            self.node_of(j + k) != self.node_of(j + k + extent)
            for j in range(0, min(period, self.world_size), block)
            for k in range(stride)
        )

    def link_for(self, group_size: int, stride: int = 1) -> LinkSpec:
        """The bottleneck link of a group (as in ``group_spans_nodes``).

        A group inside one node gets ``intra_node``. A ring over a spanning
        group has hops of both levels; its steps run at the slower bandwidth and
        the larger latency, which is ``inter_node`` whenever that is the slower
        level on both counts (all presets; with one NIC per device a cross-node
        ring moves one NIC's bandwidth per device), else a combined ``LinkSpec``.
        A group of one rank communicates with nobody; it gets ``intra_node``.
        """
        if not self.group_spans_nodes(group_size, stride):
            return self.intra_node
        inter, intra = self.inter_node, self.intra_node
        if inter.bandwidth <= intra.bandwidth and inter.latency >= intra.latency:
            return inter
        return LinkSpec(min(inter.bandwidth, intra.bandwidth), max(inter.latency, intra.latency),
                        f"{inter.name}+{intra.name}".strip("+"))

    def _check_group(self, group_size: int, stride: int) -> None:
        for name, value in (("group_size", group_size), ("stride", stride)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterError(f"{name}={value!r}: must be an integer ≥ 1")
        if self.world_size % (group_size * stride):
            raise ClusterError(
                f"group_size={group_size} × stride={stride} = {group_size * stride} does not divide the world "
                f"size {self.world_size} of {self.name}; use mesh degrees whose product divides it"
            )

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s of one device in ``dtype`` (a key of ``device.peak_flops``)."""
        if dtype not in self.device.peak_flops:
            raise ClusterError(
                f"dtype={dtype!r}: {self.device.name} has no peak FLOP/s for it; "
                f"known: {sorted(self.device.peak_flops)}; add it under device.peak_flops in a cluster file"
            )
        return self.device.peak_flops[dtype]

    def achieved_flops(self, dtype: str) -> float:
        """``peak_flops(dtype) * device.matmul_efficiency``: what a large GEMM reaches."""
        return self.peak_flops(dtype) * self.device.matmul_efficiency

    # --------------------------------------------------------------- front doors

    @classmethod
    def preset(cls, name: str, nodes: int = 1, devices_per_node: int | None = None) -> Cluster:
        """A preset cluster (names: ``cluster_presets.preset_names()``; aliases ``h100``, ``a100``).

        ``devices_per_node=None`` takes the preset's default (8 for GPUs, 1 for ``cpu``).
        """
        return cls.from_dict({"preset": name, "nodes": nodes, **_maybe("devices_per_node", devices_per_node)})

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """A preset string ``PRESET[:NODESxDEVICES]``: ``"h100-sxm:4x8"``, ``"cpu:1x2"``, ``"h200"``."""
        name, nodes, devices = cluster_io.parse_preset_spec(text, cluster_presets.preset_names())
        return cls.preset(name, nodes or 1, devices)

    @classmethod
    def load(cls, spec: str | Path) -> Cluster:
        """A cluster file if ``spec`` is one or looks like one (``.json``/``.yaml``/``.yml``, a ``/``);
        else a preset string (``parse``)."""
        if isinstance(spec, Path) or cluster_io.looks_like_file(str(spec)):
            return cls.from_file(spec)
        return cls.parse(spec)

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """Read a cluster from a JSON or YAML file (schema: ``from_dict``).

        JSON or YAML is chosen by the extension, else by the content. Without a
        ``name`` key, a file that names a ``preset`` gets ``PRESET:NxD``.
        ``calibration: PATH`` (a string) names a calibration file, relative to
        this file's directory, applied with ``with_calibration``.
        Errors name the file (missing, unparsable) or the bad key/value; a
        calibration or plan file given as a cluster file is refused as such.
        """
        data = cluster_io.read_mapping_file(path)
        kind = cluster_io.file_kind(data)
        if kind != "cluster":
            raise ClusterError(f"{str(path)!r} is a {kind} file, not a cluster file; "
                               + (f"apply it with --calibration {path} next to --cluster PRESET or a cluster file, "
                                  f"or name it in a cluster file ('calibration: {path}')" if kind == "calibration"
                                  else "give a preset such as 'h100-sxm:2x8' or a .yaml/.json cluster file"))
        calibration = data.pop("calibration", None) if isinstance(data.get("calibration"), str) else None
        try:
            cluster = cls.from_dict(data)
            if calibration is not None:
                cluster = cluster.with_calibration(Path(path).parent / calibration)
        except ClusterError as err:
            raise ClusterError(f"cluster file {str(path)!r}: {err}") from err
        return cluster

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """Build a cluster from the ``to_dict`` schema, optionally on top of a preset.

        Schema (YAML shown; JSON alike; quantities take numbers or unit strings,
        see ``cluster_io``)::

            preset: h100-sxm          # optional: start from this preset
            name: my-cluster          # default "PRESET:NODESxDEVICES"
            nodes: 4                  # default 1 with a preset
            devices_per_node: 8       # default: the preset's
            device: {name, memory_bytes: 80GiB, peak_flops: {bf16: 989e12, fp32: 67e12, ...},
                     hbm_bandwidth: 3.35TB/s, matmul_efficiency: 0.8, hbm_efficiency: 0.9}
            intra_node: {bandwidth: 370GB/s, latency: 5us, name: nvlink4}
            inter_node: {bandwidth: 25e9, latency: 10us, name: ib}
            host_bandwidth: 50GB/s
            host_memory_bytes: 2TiB
            cpu_adam_params_per_s: 1e9
            calibration: {...}        # a record, as written by to_dict (from_file: or a calibration file's path)

        With ``preset``, any key overrides the preset's (nested mappings key by
        key). Without it every key is required but the efficiencies, the link
        ``name``s, ``host_memory_bytes``, ``cpu_adam_params_per_s`` and
        ``calibration`` (which take the dataclass defaults). Unknown keys are
        errors naming the key and the allowed keys.
        """
        data = dict(cluster_io.check_keys(data, ("preset", *CLUSTER_KINDS), "cluster"))
        if "preset" in data:
            data = _on_preset(data)
        cluster_io.require_keys(data, tuple(CLUSTER_KINDS)[:7], "cluster")  # name … host_bandwidth
        fields = {key: _read_field(kind, data[key], key) for key, kind in CLUSTER_KINDS.items() if key in data}
        return cls(**fields)

    @classmethod
    def detect(cls, nodes: int | None = None) -> Cluster:
        """Probe this machine (best effort): CUDA devices, NVLink vs PCIe, host RAM; else the CPU.

        GPUs: count, name and memory from ``torch.cuda``; peak FLOP/s and link
        figures from the preset matched by device name; intra-node link from
        ``nvidia-smi topo -m`` (NVLink if any GPU pair shows ``NV#``, else
        PCIe). CPU: one device per host (or per local rank under torchrun)
        holding its share of the cores and RAM. ``nodes`` defaults to
        ``WORLD_SIZE // LOCAL_WORLD_SIZE`` under torchrun, else 1.
        """
        from autoshard import cluster_detect

        return cls.from_dict(cluster_detect.detect_dict(nodes))

    # --------------------------------------------------------------- conversions

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict in the ``from_dict`` schema (SI numbers); ``from_dict`` inverts it."""
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "device": {**dataclasses.asdict(self.device), "peak_flops": dict(self.device.peak_flops)},
            "intra_node": dataclasses.asdict(self.intra_node),
            "inter_node": dataclasses.asdict(self.inter_node),
            "host_bandwidth": self.host_bandwidth,
            "host_memory_bytes": self.host_memory_bytes,
            "cpu_adam_params_per_s": self.cpu_adam_params_per_s,
            "calibration": dict(self.calibration),
        }

    def planning_dict(self) -> dict[str, Any]:
        """The fields that change plans: ``to_dict`` without names and the calibration record."""
        data = self.to_dict()
        for key in ("name", "calibration"):
            del data[key]
        for key in ("device", "intra_node", "inter_node"):
            del data[key]["name"]
        return data

    def fingerprint(self) -> str:
        """Stable hash of ``planning_dict()``: ``"sha256:"`` + 16 hex digits (sorted-key JSON)."""
        text = json.dumps(self.planning_dict(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def with_calibration(self, measured: Mapping[str, Any] | str | Path) -> Cluster:
        """A copy with measured figures applied (a mapping, or the path of a calibration file).

        Calibration file (JSON, written by ``autoshard cluster calibrate``;
        every key optional, quantities take unit strings as in cluster files)::

            {"device": "NVIDIA H100 80GB HBM3", "date": "2025-01-31T12:00:00Z",
             "matmul_efficiency": 0.79, "hbm_efficiency": 0.9,
             "intra_node": {"bandwidth": 3.6e11, "latency": 6e-6},
             "inter_node": {"bandwidth": 4.5e10, "latency": 1.2e-5},
             "kernel_overhead_s": 8e-6, "gemm_knee_flops": 2e9,
             "adamw_s_per_param": 1.1e-10, "adamw_s_per_tensor": 9e-5,
             "layer_times": {"model": "llama:350m", "dtype": "bf16", "seq_len": 1024,
                             "samples": [{"signature": "mlp:ac8a8be383", "layer": "blocks.0.mlp", "tp": 1,
                                          "tokens": 8192, "fwd_s": 1.2e-3, "bwd_s": 2.5e-3}, ...]}}

        ``attention_efficiency``, ``kernel_overhead_s``, ``gemm_knee_flops`` and the optimizer rates (cost-model
        constants, ``search/layer_terms.py``) are kept in ``calibration`` as given;
        ``layer_times`` (the model probe) becomes one flat key per number
        (``search/measured.py``).

        A ``device`` naming hardware of another preset than this cluster's
        device is refused. ``calibration`` records what was applied.
        """
        source = f"calibration file {str(measured)!r}: " if isinstance(measured, (str, Path)) else ""
        if source:
            path, measured = measured, cluster_io.read_mapping_file(measured, file_io.CALIBRATION_FILE)
            kind = cluster_io.file_kind(measured)
            if kind != "calibration":
                raise ClusterError(f"{str(path)!r} is a {kind} file, not a calibration file; "
                                   f"{file_io.CALIBRATION_FILE.hint}"
                                   + (f" (give this one as --cluster {path})" if kind == "cluster" else ""))
        try:
            return self._apply_calibration(measured)
        except ClusterError as err:  # the checks shared with cluster files name the calibration file's fix
            raise ClusterError(source + str(err).replace(_FIX_CLUSTER, _FIX_CALIBRATION)) from err

    def _apply_calibration(self, measured: Mapping[str, Any]) -> Cluster:
        measured = cluster_io.check_keys(dict(measured), CALIBRATION_KEYS, "calibration")
        for key in ("device", "date"):
            if key in measured:
                _name(f"calibration.{key}", measured[key])
        cluster_presets.check_same_hardware(str(measured.get("device", "")), self.device.name)
        overrides = {
            key: dict(measured[key]) if isinstance(measured[key], Mapping) else measured[key]
            for key in CALIBRATION_KEYS[2:]
            if key in measured
        }
        for link in ("intra_node", "inter_node"):
            if link in overrides:
                cluster_io.check_keys(overrides[link], ("bandwidth", "latency"), f"calibration.{link}")
        device_overrides = {k: overrides.pop(k) for k in ("matmul_efficiency", "hbm_efficiency") if k in overrides}
        constants = {k: _constant(k, overrides.pop(k)) for k in _COST_MODEL_KEYS if k in overrides}
        constants.update(_layer_time_keys(overrides.pop("layer_times", None)))
        if overrides.pop("plan_residuals", None) is not None:  # files written before residuals were dropped
            log.warning("calibration: 'plan_residuals' (per-plan fitted times) are no longer read; the cost "
                        "model uses only what the calibration measured on the machine")
        data = cluster_io.deep_merge(self.to_dict(), {"device": device_overrides, **overrides})
        applied = _flatten(self.from_dict(data).to_dict(), measured)
        data["calibration"] = {**self.calibration, **applied, **constants}
        return self.from_dict(data)

    def describe(self) -> Any:
        """A ``rich.table.Table`` for ``autoshard cluster show``: device, memory, FLOP/s, links, world size."""
        return cluster_io.describe_table(self)


def check_calibration(path: str | Path) -> None:
    """Raise the ``ClusterError`` ``with_calibration`` would for the calibration file at ``path`` on any
    cluster (the hardware check aside: ``autoshard cluster show FILE`` has no cluster to compare with)."""
    cpu = Cluster.preset("cpu")
    unmatched = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, name="calibration check"))
    unmatched.with_calibration(path)


def describe_calibration_file(path: str | Path, data: dict[str, Any]) -> Any:
    """Two-column ``rich`` table of a calibration file for ``autoshard cluster show FILE``: the machine it was
    measured on, when, and each figure it measured (checked as ``Cluster.with_calibration`` checks it)."""
    from rich.table import Table

    check_calibration(path)
    table = Table(title=f"calibration file {Path(path)}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for row in cluster_io.calibration_rows(data):
        table.add_row(*row)
    table.add_row("use it", f"--calibration {path} (plan, explain, ppo, run), or 'calibration: {path}' in a "
                            "cluster file")
    return table


def _maybe(key: str, value: Any) -> dict[str, Any]:
    return {} if value is None else {key: value}


def _on_preset(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` merged over the preset it names, with the default name ``PRESET:NxD``."""
    requested = data.pop("preset")
    name = cluster_presets.resolve(requested) if isinstance(requested, str) else None
    if name is None:
        aliases = ", ".join(f"{a}→{p}" for a, p in sorted(cluster_presets.ALIASES.items()))
        raise ClusterError(
            f"unknown cluster preset {requested!r}; presets: {', '.join(cluster_presets.preset_names())} "
            f"(aliases {aliases}), or describe the cluster in a .yaml/.json file (see Cluster.from_file)"
        )
    merged = cluster_io.deep_merge({"nodes": 1, **cluster_presets.PRESETS[name]}, data)
    nodes, devices = merged["nodes"], merged["devices_per_node"]
    merged.setdefault("name", f"{name}:{nodes}x{devices}")
    return merged


def _read_field(kind: str, value: Any, where: str) -> Any:
    """One field of the ``from_dict`` schema → its typed value (units parsed, keys checked)."""
    if kind == "str":
        _name(where, value)
        return value
    if kind == "count":
        return cluster_io.parse_count(value, where)
    if kind == "bytes":
        num_bytes = round(cluster_io.parse_quantity(value, "bytes", where))
        if num_bytes > file_io.MAX_INT:  # int64 everywhere downstream; far above any real memory
            raise _fail(where, value, "must be at most 2**63 - 1 bytes")
        return num_bytes
    if kind in ("bytes/s", "seconds", "number"):
        return cluster_io.parse_quantity(value, kind, where)
    if kind == "flops_map":
        cluster_io.check_keys(value, DTYPES, where)
        return {dtype: cluster_io.parse_quantity(v, "flop/s", f"{where}.{dtype}") for dtype, v in value.items()}
    if kind in ("device", "link"):
        kinds, cls = (DEVICE_KINDS, DeviceSpec) if kind == "device" else (LINK_KINDS, LinkSpec)
        cluster_io.check_keys(value, tuple(kinds), where)
        required = tuple(k for k in kinds if k not in ("matmul_efficiency", "hbm_efficiency", "name"))
        cluster_io.require_keys(value, required + (("name",) if kind == "device" else ()), where)
        return cls(**{k: _read_field(kinds[k], v, f"{where}.{k}") for k, v in value.items()})
    assert kind == "calibration", kind
    if not isinstance(value, Mapping):
        raise _fail(where, value, "must be a mapping")
    return {str(k): v if isinstance(v, str) else cluster_io.parse_quantity(v, "number", f"{where}.{k}")
            for k, v in value.items()}


def _constant(key: str, value: Any) -> float:
    """A cost-model constant of a calibration file, checked against ``_COST_MODEL_RANGES``."""
    where = f"calibration.{key}"
    number = cluster_io.parse_quantity(value, "seconds" if key.endswith("_s") else "number", where)
    low, high, low_ok = _COST_MODEL_RANGES[key]
    if not (low <= number <= high if low_ok else low < number <= high):
        bounds = f"{'[' if low_ok else '('}{low:g}, {high:g}]"
        raise ClusterError(f"{where}={value!r}: must be in {bounds}; {_FIX_CALIBRATION}")
    return number


def _probe_count(value: Any, where: str) -> int:
    """An integer ≥ 1 of the model probe (``tp``, ``tokens``, ``seq_len``), at most 2**63 - 1."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= file_io.MAX_INT:
        raise ClusterError(f"{where}={value!r}: expected an integer in [1, 2**63 - 1]; {_FIX_CALIBRATION}")
    return value


def layer_time_key(signature: str, dtype: str, tp: int, seq_len: int, tokens: int, field: str) -> str:
    """The flat ``cluster.calibration`` key of one probed number (``search/measured.py`` reads them)."""
    return f"{LAYER_TIME_KEY_PREFIX}|{signature}|{dtype}|tp={tp}|seq={seq_len}|tokens={tokens}|{field}"


def _layer_time_keys(probe: Mapping[str, Any] | None) -> dict[str, float | str]:
    """The model probe of a calibration file as flat ``cluster.calibration`` keys (``layer_time_key``)."""
    if probe is None:
        return {}
    cluster_io.check_keys(probe, _LAYER_TIMES_KEYS + _LAYER_TIMES_OPTIONAL, "calibration.layer_times")
    cluster_io.require_keys(probe, _LAYER_TIMES_KEYS, "calibration.layer_times")
    for key in ("model", "dtype"):
        _name(f"calibration.layer_times.{key}", probe[key])
    seq_len = _probe_count(probe["seq_len"], "calibration.layer_times.seq_len")
    if not isinstance(probe["samples"], (list, tuple)):
        raise _fail("calibration.layer_times.samples", probe["samples"], "must be a list of samples")
    out: dict[str, float | str] = {"layer_times.model": probe["model"]}
    if "compiled_saved_scale" in probe:
        scale = cluster_io.parse_quantity(probe["compiled_saved_scale"], "number", "calibration.layer_times.compiled_saved_scale")
        if not 0.0 < scale <= 1.0:
            raise ClusterError(f"calibration.layer_times.compiled_saved_scale={scale!r}: must be in (0, 1]")
        out[COMPILED_SAVED_SCALE_KEY] = scale
    for i, sample in enumerate(probe["samples"]):
        where = f"calibration.layer_times.samples[{i}]"
        cluster_io.check_keys(sample, _LAYER_SAMPLE_KEYS, where)
        cluster_io.require_keys(sample, _LAYER_SAMPLE_KEYS, where)
        for key in ("signature", "layer"):
            _name(f"{where}.{key}", sample[key])
        tp, tokens = (_probe_count(sample[key], f"{where}.{key}") for key in ("tp", "tokens"))
        for field in ("fwd_s", "bwd_s"):
            seconds = cluster_io.parse_quantity(sample[field], "seconds", f"{where}.{field}")
            if seconds < 0:
                raise ClusterError(f"{where}.{field}={sample[field]!r}: must be ≥ 0 seconds; {_FIX_CALIBRATION}")
            out[layer_time_key(sample["signature"], probe["dtype"], tp, seq_len, tokens, field)] = seconds
    return out


def _flatten(applied: dict[str, Any], measured: Mapping[str, Any]) -> dict[str, float | str]:
    """The calibration record: the measured keys, flattened, with their values as applied (SI)."""
    record: dict[str, float | str] = {k: str(measured[k]) for k in ("device", "date") if k in measured}
    for key in ("matmul_efficiency", "hbm_efficiency"):
        if key in measured:
            record[key] = applied["device"][key]
    for link in ("intra_node", "inter_node"):
        for key in measured.get(link, {}):
            record[f"{link}.{key}"] = applied[link][key]
    return record
