"""``Cluster.detect()``: describe this machine, best effort.

Decisions:

- GPUs (``torch.cuda``): count, name and total memory are read; peak FLOP/s,
  HBM, link and host figures come from the preset matched by device name
  (``cluster_presets.match_device_name``); a GPU matching no preset is an error
  (its figures would mislead the planner) telling the user to write a file.
- Intra-node link: ``nvidia-smi topo -m``; any ``NV#`` cell between two GPUs
  means NVLink (the preset's link is kept); GPUs that only meet over PCIe
  (``PIX PXB PHB NODE SYS``) get a PCIe link (``0.8 × host_bandwidth``, 10 µs),
  since the ring then runs through the PCIe switches; no ``nvidia-smi`` or one
  GPU: the preset's link, unchanged.
- CPU (no CUDA device): the ``cpu`` preset, with one device per local rank
  (``LOCAL_WORLD_SIZE`` under torchrun, else 1); each device gets its share of
  the cores (FLOP/s scale with cores per rank) and of the RAM.
- Nodes cannot be seen from one machine: ``nodes`` is an argument, defaulting to
  ``WORLD_SIZE // LOCAL_WORLD_SIZE`` under torchrun, else 1.
- Host RAM: ``MemTotal`` of ``/proc/meminfo``, else ``os.sysconf``; 0 if neither.

The result is a ``from_dict`` mapping over a preset, so it is validated as any file is.
Checked on this project's GPU machines: 2×"NVIDIA H200" (topology ``NV18``, whose
piped ``nvidia-smi`` header carries ANSI underline escapes) gave
``detected:h200:1x2`` with the NVLink figures; 1×"NVIDIA H100 80GB HBM3" gave
``detected:h100-sxm:1x1``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from autoshard import cluster_presets
from autoshard.errors import ClusterError

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PCIE_LATENCY_S = 10e-6
_PCIE_RING_FRACTION = 0.8  # ring through PCIe switches shares uplinks (cluster_presets: h100-pcie)


def detect_dict(nodes: int | None = None) -> dict[str, Any]:
    """A ``Cluster.from_dict`` mapping describing this machine (see module docstring)."""
    nodes = nodes if nodes is not None else nodes_from_env(os.environ)
    gpu = _cuda_device()
    if gpu is not None:
        count, name, memory = gpu
        return gpu_dict(name, memory, count, nodes, _nvidia_smi_topology())
    return cpu_dict(nodes, os.cpu_count() or 1, host_memory_bytes(), _local_ranks(os.environ), _cpu_name())


def nodes_from_env(env: dict[str, str] | os._Environ) -> int:
    """``WORLD_SIZE // LOCAL_WORLD_SIZE`` when torchrun set both (and they divide), else 1."""
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0 and int(world) % int(local) == 0:
        return max(1, int(world) // int(local))
    return 1


def _local_ranks(env: dict[str, str] | os._Environ) -> int:
    local = env.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else 1


def gpu_dict(name: str, memory_bytes: int, count: int, nodes: int, topology: str | None) -> dict[str, Any]:
    """The mapping for ``count`` GPUs called ``name`` per node; ``topology`` is ``nvidia-smi topo -m`` text."""
    preset = cluster_presets.match_device_name(name)
    if preset is None:
        raise ClusterError(
            f"detected GPU {name!r} matches no preset ({', '.join(cluster_presets.preset_names())}); "
            "describe it in a cluster file: 'preset: <closest>' plus device overrides (see Cluster.from_file)"
        )
    data: dict[str, Any] = {
        "preset": preset,
        "name": f"detected:{preset}:{nodes}x{count}",
        "nodes": nodes,
        "devices_per_node": count,
        "device": {"name": name, "memory_bytes": memory_bytes},
    }
    host_memory = host_memory_bytes()
    if host_memory:
        data["host_memory_bytes"] = host_memory
    if count > 1 and link_kind(topology) == "pcie" and not preset.endswith("pcie"):
        host_bandwidth = cluster_presets.PRESETS[preset]["host_bandwidth"]
        data["intra_node"] = {"name": "pcie", "bandwidth": _PCIE_RING_FRACTION * host_bandwidth,
                              "latency": _PCIE_LATENCY_S}
    return data


def cpu_dict(nodes: int, cores: int, ram_bytes: int, local_ranks: int, cpu_name: str) -> dict[str, Any]:
    """The mapping for a CPU host running ``local_ranks`` ranks over ``cores`` cores and ``ram_bytes`` of RAM."""
    base = cluster_presets.PRESETS["cpu"]
    cores_per_rank = max(1, cores // local_ranks)
    data: dict[str, Any] = {
        "preset": "cpu",
        "name": f"detected:cpu:{nodes}x{local_ranks}",
        "nodes": nodes,
        "devices_per_node": local_ranks,
        "device": {
            "name": f"{cpu_name} ({cores_per_rank} core(s)/rank)",
            "peak_flops": {k: v * cores_per_rank for k, v in base["device"]["peak_flops"].items()},
        },
    }
    if ram_bytes:
        data["device"]["memory_bytes"] = ram_bytes // local_ranks
        data["host_memory_bytes"] = ram_bytes
    return data


def link_kind(topology: str | None) -> str | None:
    """``"nvlink"`` / ``"pcie"`` from ``nvidia-smi topo -m`` text; ``None`` if it shows < 2 GPUs.

    The matrix's header names the columns (``GPU0 GPU1 NIC0 CPU Affinity …``);
    each ``GPUi`` row's first cells are its links to every GPU (``X`` = itself).
    """
    if not topology:
        return None
    topology = _ANSI_ESCAPE.sub("", topology)  # nvidia-smi underlines the header even when piped
    lines = [line.split() for line in topology.splitlines() if line.strip()]
    header = next((cells for cells in lines if cells and re.fullmatch(r"GPU\d+", cells[0])), None)
    if header is None:
        return None
    num_gpus = sum(1 for cell in header if re.fullmatch(r"GPU\d+", cell))
    if num_gpus < 2:
        return None
    rows = [cells[1 : 1 + num_gpus] for cells in lines if re.fullmatch(r"GPU\d+", cells[0]) and cells is not header]
    nvlink = any(re.fullmatch(r"NV\d+", cell) for row in rows for cell in row)
    return "nvlink" if nvlink else "pcie"


def host_memory_bytes() -> int:
    """Host RAM in bytes: ``/proc/meminfo`` ``MemTotal``, else ``os.sysconf``, else 0 (unknown)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        match = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo.read_text(), re.MULTILINE)
        if match:
            return int(match[1]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def _cuda_device() -> tuple[int, str, int] | None:
    """``(count, name, total_memory)`` of the visible CUDA devices (device 0 speaks for all), or ``None``."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    props = torch.cuda.get_device_properties(0)
    return torch.cuda.device_count(), props.name, int(props.total_memory)


def _nvidia_smi_topology() -> str | None:
    """``nvidia-smi topo -m`` output, or ``None`` if the tool is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        if match:
            return match[1].strip()
    return "CPU"
