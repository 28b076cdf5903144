"""Text in and out of ``Cluster``: preset strings, cluster files, unit strings, the summary table.

Everything here turns user text into the plain nested dict that
``Cluster.from_dict`` builds from (the ``Cluster.to_dict`` schema), and every
mistake becomes a ``ClusterError`` naming the bad value, what is allowed and
the next step. Files are read by ``autoshard/file_io.py``'s strict rules
(regular files of at most 16 MiB, UTF-8, nesting ≤ 64, no duplicate keys, no
YAML aliases); nothing read is executed (a ``yaml.SafeLoader`` subclass).
Counts (``nodes``, ``devices_per_node``) are integers in
``[1, file_io.MAX_WORLD_SIZE]``, and a preset string's ``NODES*DEVICES`` too.

Preset strings: ``PRESET[:NODESxDEVICES]``, e.g. ``h100-sxm:4x8``, ``cpu:1x2``;
a bare ``PRESET`` is one node with the preset's default devices per node.

Quantities in files may be numbers (SI base units: bytes, bytes/s, seconds,
FLOP/s) or strings with a unit, parsed strictly (the unit must fit the field):

| field kind | accepted units (case-sensitive) | example |
| --- | --- | --- |
| bytes | ``B``, ``KB MB GB TB`` (10³ⁿ), ``KiB MiB GiB TiB`` (2¹⁰ⁿ) | ``"80GiB"`` |
| bytes/s | a bytes unit + ``/s``; bits: ``Kb/s Mb/s Gb/s Tb/s`` (÷ 8) | ``"900GB/s"``, ``"400Gb/s"`` |
| seconds | ``s ms us µs ns`` | ``"10us"`` |
| FLOP/s | ``FLOP/s`` or ``FLOPS`` with prefix ``K M G T P`` | ``"989TFLOP/s"`` |

A plain number may also be written as a string (``"25e9"``): YAML 1.1 reads
``25e9`` (no dot) as a string, so that spelling must keep working.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoshard import file_io
from autoshard.errors import ClusterError

if TYPE_CHECKING:
    from rich.table import Table

    from autoshard.cluster import Cluster, LinkSpec

_NUMBER = r"[0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?"
_QUANTITY_RE = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*(?P<unit>[A-Za-zµ/]*)\s*$")
_SPEC_RE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?::(?P<nodes>[^x:]*)x(?P<devices>[^x:]*))?$")

# The cluster file's schema: each key and the kind of value it holds (Cluster.from_dict reads by kind).
DEVICE_KINDS = {
    "name": "str",
    "memory_bytes": "bytes",
    "peak_flops": "flops_map",
    "hbm_bandwidth": "bytes/s",
    "matmul_efficiency": "number",
    "hbm_efficiency": "number",
}
LINK_KINDS = {"name": "str", "bandwidth": "bytes/s", "latency": "seconds"}
CLUSTER_KINDS = {
    "name": "str",
    "nodes": "count",
    "devices_per_node": "count",
    "device": "device",
    "intra_node": "link",
    "inter_node": "link",
    "host_bandwidth": "bytes/s",
    "host_memory_bytes": "bytes",
    "cpu_adam_params_per_s": "number",
    "calibration": "calibration",
}
# the top-level keys of a calibration file (file_kind, Cluster.with_calibration)
CALIBRATION_KEYS = ("device", "date", "matmul_efficiency", "hbm_efficiency", "intra_node", "inter_node",
                    "attention_efficiency", "overlap_contention", "overlap_efficiency", "kernel_overhead_s", "gemm_knee_flops", "adamw_s_per_param", "adamw_s_per_tensor",
                    "graph_kernel_s", "graph_compiled_kernel_s", "graph_collective_s", "eager_kernel_s", "eager_inference_kernel_s", "layer_times",
                    "plan_residuals")

_SI = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_BYTE_UNITS = {"B": 1.0, **{p + "B": f for p, f in _SI.items() if p != "P"}, **{p + "B": f for p, f in _BIN.items()}}
_UNITS: dict[str, dict[str, float]] = {
    "bytes": _BYTE_UNITS,
    "bytes/s": {
        **{u + "/s": f for u, f in _BYTE_UNITS.items()},
        **{p + "b/s": f / 8 for p, f in _SI.items() if p != "P"},
    },
    "seconds": {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9},
    "flop/s": {
        **{"FLOP/s": 1.0, "FLOPS": 1.0},
        **{p + "FLOP/s": f for p, f in _SI.items()},
        **{p + "FLOPS": f for p, f in _SI.items()},
    },
    "number": {},
}

PRESET_SPEC_FORM = "PRESET[:NODESxDEVICES], e.g. 'h100-sxm:4x8' or 'cpu:1x2'"


def parse_quantity(value: Any, kind: str, where: str) -> float:
    """Parse a number or a unit string of ``kind`` (a key of the table above) to SI units.

    ``where`` names the field for the error message (``"device.memory_bytes"``).
    Raises ``ClusterError`` for a bool, a non-finite number, an unknown unit or
    a unit of another kind (``"10us"`` for a bandwidth).
    """
    assert kind in _UNITS, kind
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ClusterError(f"{where}={value!r}: expected a number{_unit_hint(kind)}")
    if isinstance(value, str):
        match = _QUANTITY_RE.match(value)
        units = _UNITS[kind]
        if match is None or (match["unit"] and match["unit"] not in units):
            raise ClusterError(f"{where}={value!r}: cannot read it as a number{_unit_hint(kind)}")
        value = float(match["number"].replace("_", "")) * units.get(match["unit"], 1.0)
    elif isinstance(value, int) and abs(value) > file_io.MAX_INT:  # 10**400 would overflow float()
        raise ClusterError(f"{where}={value!r}: more than 2**63 - 1; fix the value")
    if not math.isfinite(value):
        raise ClusterError(f"{where}={value!r}: must be a finite number")
    return value


def _unit_hint(kind: str) -> str:
    units = list(_UNITS[kind])
    return f" or a string with one of the units {units}" if units else ""


def parse_count(value: Any, where: str) -> int:
    """An integer count (``nodes``, ``devices_per_node``); integral floats are accepted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterError(f"{where}={value!r}: expected an integer ≥ 1")
    if value > file_io.MAX_WORLD_SIZE:
        raise ClusterError(f"{where}={value!r}: more than {file_io.MAX_WORLD_SIZE} (2**20) ranks; fix the count")
    return value


def parse_preset_spec(text: str, presets: list[str]) -> tuple[str, int | None, int | None]:
    """Split ``PRESET[:NODESxDEVICES]`` into ``(preset, nodes, devices_per_node)``.

    The preset name is returned as written (lower-cased); whether it exists is
    the caller's check. ``nodes``/``devices_per_node`` are ``None`` when absent.
    """
    if not isinstance(text, str):
        raise ClusterError(f"cluster spec {text!r}: expected a string of the form {PRESET_SPEC_FORM}")
    match = _SPEC_RE.match(text.strip())
    if match is None:
        raise ClusterError(
            f"cluster spec {text!r}: expected {PRESET_SPEC_FORM}; presets: {', '.join(presets)}"
        )
    if match["nodes"] is None:
        return match["name"].lower(), None, None
    nodes = _spec_count(match["nodes"], "nodes", text)
    devices = _spec_count(match["devices"], "devices per node", text)
    if nodes * devices > file_io.MAX_WORLD_SIZE:
        raise ClusterError(f"cluster spec {text!r}: {nodes}x{devices} is more than {file_io.MAX_WORLD_SIZE} (2**20) "
                           f"ranks; fix the counts ({PRESET_SPEC_FORM})")
    return match["name"].lower(), nodes, devices


def _spec_count(digits: str, what: str, text: str) -> int:
    # ascii digits only ("²" is a digit to str.isdigit, not to int); 8+ digits exceed MAX_WORLD_SIZE anyway
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 7 or int(digits) < 1:
        raise ClusterError(
            f"cluster spec {text!r}: {what} {digits!r} must be an integer ≥ 1 and ≤ 2**20 ({PRESET_SPEC_FORM})"
        )
    return int(digits)


def looks_like_file(spec: str) -> bool:
    """Whether ``Cluster.load`` should treat ``spec`` as a path rather than a preset string."""
    return Path(spec).suffix.lower() in (".json", ".yaml", ".yml") or "/" in spec or Path(spec).is_file()


def read_mapping_file(path: str | Path, kind: file_io.FileKind = file_io.CLUSTER_FILE) -> dict[str, Any]:
    """Read a JSON or YAML file holding one mapping (``file_io``'s strict rules and ``kind``'s limit and
    noun: ``CLUSTER_FILE`` or ``CALIBRATION_FILE``).

    The format comes from the extension (``.json``, ``.yaml``/``.yml``); any
    other extension is read as JSON when the text starts with ``{`` and as YAML
    otherwise. Errors name the file and the problem: missing, not a regular
    file, too large, not UTF-8, unparsable, too deeply nested, a duplicate key.
    """
    path = Path(path)
    text = file_io.read_bounded_text(path, kind)
    source = f"{kind.noun} {str(path)!r}"
    as_json = path.suffix.lower() == ".json" or (
        path.suffix.lower() not in (".yaml", ".yml") and text.lstrip().startswith("{")
    )
    parse = file_io.parse_json_strict if as_json else file_io.parse_yaml_strict
    data = parse(text, source=source, kind=kind)
    if not isinstance(data, dict):
        raise ClusterError(f"{source}: expected a mapping at the top level, got {type(data).__name__}; {kind.hint}")
    return data


def check_keys(data: Any, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    """Return ``data`` if it is a mapping whose keys are all in ``allowed``; else raise."""
    if not isinstance(data, dict):
        raise ClusterError(f"{where}: expected a mapping with keys {list(allowed)}, got {data!r}")
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {unknown}; allowed keys: {list(allowed)}")
    return data


def require_keys(data: dict[str, Any], required: tuple[str, ...], where: str) -> None:
    """Raise naming every missing key of ``required``."""
    missing = [k for k in required if k not in data]
    if missing:
        raise ClusterError(
            f"{where}: missing key(s) {missing}; give them, or start from a preset with 'preset: NAME'"
        )


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``override``, nested mappings merged key by key (inputs untouched)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def describe_table(cluster: Cluster) -> Table:
    """Two-column ``rich`` table of ``cluster`` for ``autoshard cluster show``."""
    from rich.table import Table

    device = cluster.device
    table = Table(title=f"cluster {cluster.name}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    rows = [
        ("world size", f"{cluster.world_size} = {cluster.nodes} node(s) × {cluster.devices_per_node} device(s)"),
        ("device", device.name),
        ("memory / device", _human(device.memory_bytes, "B", binary=True)),
        ("peak FLOP/s", ", ".join(f"{k} {_human(v, 'FLOP/s')}" for k, v in device.peak_flops.items())),
        ("matmul efficiency", f"{device.matmul_efficiency:.2f}"),
        ("HBM bandwidth", f"{_human(device.hbm_bandwidth, 'B/s')} (× {device.hbm_efficiency:.2f} achieved)"),
        ("intra-node link", _link(cluster.intra_node)),
        ("inter-node link", _link(cluster.inter_node) + ("" if cluster.nodes > 1 else " (unused: 1 node)")),
        ("host link / device", _human(cluster.host_bandwidth, "B/s")),
        ("host memory / node", _human(cluster.host_memory_bytes, "B", binary=True) or "unknown"),
        ("CPU Adam / device", f"{cluster.cpu_adam_params_per_s:.3g} params/s"),
        ("fingerprint", cluster.fingerprint()),
    ]
    for row in rows:
        table.add_row(*row)
    table.rows[-1].end_section = bool(cluster.calibration)  # the calibration below a rule
    for row in calibration_rows(cluster.calibration):
        table.add_row(*row)
    return table


# ------------------------------------------------------------------ calibration files
# Human rows of a calibration: (key, label, how to print its value). Keys are those of a calibration file
# and of the flat record ``Cluster.calibration`` (``"intra_node.bandwidth"``); ``layer_times`` is summarised.
_CALIBRATION_LABELS: tuple[tuple[str, str, str], ...] = (
    ("matmul_efficiency", "matmul efficiency", "ratio"),
    ("hbm_efficiency", "HBM efficiency", "ratio"),
    ("attention_efficiency", "attention efficiency", "ratio"),
    ("kernel_overhead_s", "kernel overhead", "seconds"),
    ("gemm_knee_flops", "GEMM knee", "flop"),
    ("intra_node.bandwidth", "intra-node bandwidth", "bytes/s"),
    ("intra_node.latency", "intra-node latency α", "seconds"),
    ("inter_node.bandwidth", "inter-node bandwidth", "bytes/s"),
    ("inter_node.latency", "inter-node latency α", "seconds"),
    ("overlap_contention", "overlap contention κ", "ratio"),
    ("overlap_efficiency", "overlap efficiency f", "ratio"),
    ("adamw_s_per_param", "AdamW per parameter", "seconds"),
    ("adamw_s_per_tensor", "AdamW per tensor", "seconds"),
)


def file_kind(data: dict[str, Any]) -> str:
    """What a mapping read from a file is: ``"plan"``; ``"calibration"`` (a key only ``autoshard cluster
    calibrate`` writes, such as ``matmul_efficiency`` at the top, and no key only cluster files have); else
    ``"cluster"``. A damaged file keeps its kind, so its own reader names what is wrong."""
    if data.get("format") == "autoshard.plan":
        return "plan"
    shared = {"device", "intra_node", "inter_node"}
    cluster_only = ({"preset", *CLUSTER_KINDS} - shared) & set(data)
    if not cluster_only and (set(CALIBRATION_KEYS) - shared) & set(data):
        return "calibration"
    return "cluster"


def calibration_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field, value)`` rows of a calibration in units (``Cluster.calibration``'s flat keys or a calibration
    file's nested ones): where and when it was measured, each measured figure, the layer-time samples."""
    if not record:
        return []
    flat = _flat_calibration(record)
    rows = [("calibrated on", " ".join(str(flat[k]) for k in ("device", "date") if k in flat) or "(not recorded)")]
    for key, label, kind in _CALIBRATION_LABELS:
        if key in flat:
            rows.append((label, _calibration_value(flat[key], kind)))
    samples = sum(1 for k in flat if k.startswith("layer_time") and k.endswith("fwd_s"))
    if "layer_times.model" in flat:
        scale = flat.get("layer_times.compiled_saved_scale")
        rows.append(("layer times", f"{samples} layer sample(s) of {flat['layer_times.model']} (forward and "
                                    "backward seconds)"
                                    + (f", compiled activation scale {scale:.3g}" if scale is not None else "")))
    return rows


def _flat_calibration(record: dict[str, Any]) -> dict[str, Any]:
    """A calibration file's nested ``intra_node``/``inter_node``/``layer_times`` as the record's flat keys."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if key in ("intra_node", "inter_node") and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        elif key == "layer_times" and isinstance(value, dict):
            flat["layer_times.model"] = value.get("model", "?")
            samples = value.get("samples", ())
            flat.update({f"layer_times.{i}.fwd_s": 0.0 for i in range(len(samples) if isinstance(samples, list) else 0)})
            if "compiled_saved_scale" in value:
                flat["layer_times.compiled_saved_scale"] = value["compiled_saved_scale"]
        else:
            flat[key] = value
    return flat


def _calibration_value(value: Any, kind: str) -> str:
    if isinstance(value, str):  # a unit string of a hand-edited file, as written
        return value
    if kind == "ratio":
        return f"{value:.3g}"
    if kind == "seconds":
        return format_seconds(value)
    if kind == "flop":
        return f"{value:.3g} FLOP"
    return _human(value, "B/s") or "0 B/s"


def format_seconds(seconds: float) -> str:
    """``6e-06`` → ``"6 µs"``: s, ms, µs, ns or ps with 3 significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-12:.3g} ps" if seconds else "0 s"


def _link(link: LinkSpec) -> str:
    label = f"{link.name}: " if link.name else ""
    return f"{label}{_human(link.bandwidth, 'B/s')} per device per direction, α {link.latency * 1e6:.3g} µs"


def _human(value: float, unit: str, *, binary: bool = False) -> str:
    """``_human(3.35e12, "B/s")`` → ``"3.35 TB/s"``; binary prefixes (GiB) for memory sizes."""
    if value == 0:
        return ""
    base, prefixes = (1024.0, ("", "Ki", "Mi", "Gi", "Ti", "Pi")) if binary else (1000.0, ("", "K", "M", "G", "T", "P"))
    exponent = min(int(math.log(abs(value), base)), len(prefixes) - 1) if abs(value) >= 1 else 0
    return f"{value / base**exponent:.3g} {prefixes[exponent]}{unit}"
