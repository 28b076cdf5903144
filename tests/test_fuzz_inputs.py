"""Fuzz corpus: generated bad inputs through every CLI command that reads a file (docs/reliability.md).

Each case writes one damaged file (a valid plan, cluster, calibration or metrics file mutated by a
hypothesis strategy, or a hand-written special case), runs the command in-process and asserts the
contract of ``autoshard/cli.py``: exit 2, exactly one stderr line starting ``autoshard: error: ``
that names the file, no traceback, and at most ``CASE_SECONDS`` of wall time. Calibration files
have no command that reads them (``Cluster.with_calibration``, used by scripts), so they are checked
through that API with the same contract: one ``AutoshardError`` line naming the calibration file.

Every mutation is bad by the file's documented schema, never merely unusual: a number is put only
where the field's range refuses it (``ZERO_OK`` lists the fields where 0 is valid), a wrong type
only where the field's type refuses it, a truncation only where it cuts a value or a required key.
Examples are derandomized, so CI runs the same corpus every time; ``CORPUS`` counts them
(``test_corpus_size``: at least 200 distinct generated inputs).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _harness import no_hang
from autoshard.cli import main
from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.plan import LayerStrategy, Mesh, Plan, Predictions, Schedule

CASE_SECONDS = 5.0
PREFIX = "autoshard: error: "
CORPUS: dict[str, set[str]] = collections.defaultdict(set)  # kind → digests of the generated inputs run
OPS: collections.Counter = collections.Counter()  # (kind, operation) → distinct inputs (for the summary)

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


def examples(n: int) -> Callable:
    """``FUZZ`` with ``n`` examples."""
    return settings(FUZZ, max_examples=n)


# ------------------------------------------------------------------ valid bases
def _plan_dict() -> dict[str, Any]:
    predictions = Predictions(step_time_s=0.5, compute_s=0.3, exposed_comm_s=0.1, bubble_s=0.05, optimizer_s=0.05,
                              peak_memory_bytes=2**30, memory_by_stage=(2**30,), memory_breakdown={"params": 2**20},
                              tokens_per_s=1000.0, mfu=0.4, build_peak_bytes=2**20)
    plan = Plan("m", Mesh(dp_shard=2), (LayerStrategy("a"), LayerStrategy("b", state="zero3")),
                schedule=Schedule(micro_batch=2, num_micro_batches=2), predictions=predictions,
                global_batch=8, seq_len=8)
    return plan.to_dict()


PLAN = _plan_dict()
CLUSTER = Cluster.parse("cpu:1x2").to_dict()
CLUSTER.pop("calibration")  # optional, and a free-form record: nothing in it is refused
CALIBRATION = {
    "device": "CPU core", "date": "2025-01-31T12:00:00Z", "matmul_efficiency": 0.7, "hbm_efficiency": 0.8,
    "intra_node": {"bandwidth": 1e9, "latency": 1e-4}, "attention_efficiency": 0.3, "overlap_contention": 0.2,
    "overlap_efficiency": 0.9, "kernel_overhead_s": 8e-6, "gemm_knee_flops": 2e9, "adamw_s_per_param": 1e-10,
    "adamw_s_per_tensor": 1e-5,
    "layer_times": {"model": "llama:tiny", "dtype": "fp32", "seq_len": 32,
                    "samples": [{"signature": "mlp:ab12", "layer": "blocks.0.mlp", "tp": 1, "tokens": 64,
                                 "fwd_s": 1e-3, "bwd_s": 2e-3}]},
}
METRICS = [{"step": s, "reward/mean": 0.1 * s, "kl/k1": None, "perf/tokens_per_s": 1e3} for s in (1, 2, 3)]

# fields where 0 is a valid value (all others refuse 0 and every field refuses -1)
ZERO_OK = {
    "plan": {"stage", "prefetch", "bucket_bytes", "step_time_s", "compute_s", "exposed_comm_s", "bubble_s",
             "optimizer_s", "peak_memory_bytes", "tokens_per_s", "mfu", "build_peak_bytes", "wall_s",
             "meshes_considered", "meshes_solved"},
    "cluster": {"latency", "host_memory_bytes"},
    "calibration": {"latency", "overlap_contention", "kernel_overhead_s", "gemm_knee_flops", "adamw_s_per_param",
                    "adamw_s_per_tensor", "fwd_s", "bwd_s"},
}
# numeric leaves with no range (a plan's solver objective may be negative; byte counts in maps are unchecked)
NO_RANGE = {"plan": {"objective", "bound", "gap", "memory_by_stage", "memory_breakdown"}}
# subtrees whose keys or types are free-form (a plan's recorded cluster spec, a byte breakdown by name)
FREE_FORM = {"plan": ("fingerprints.cluster_spec", "predictions.memory_breakdown")}
OPTIONAL = {  # keys a file may omit (everything else is required)
    "plan": {"build_peak_bytes", "caveats"},
    "cluster": {"matmul_efficiency", "hbm_efficiency", "host_memory_bytes", "cpu_adam_params_per_s",
                "intra_node.name", "inter_node.name"},
    "calibration": set(CALIBRATION) | {"intra_node.bandwidth", "intra_node.latency"},
}


# ---------------------------------------------------------------- tree helpers
Path_ = tuple  # a path into JSON data: keys and list indices


def _walk(node: Any, path: Path_ = ()) -> list[tuple[Path_, Any]]:
    """Every (path, value) below ``node``, parents before children."""
    found = [(path, node)] if path else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        found += _walk(child, (*path, key))
    return found


def _dotted(path: Path_) -> str:
    return ".".join(str(p) for p in path if not isinstance(p, int))


def _replace(data: Any, path: Path_, value: Any) -> Any:
    data = json.loads(json.dumps(data))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def _drop(data: Any, path: Path_) -> Any:
    data = json.loads(json.dumps(data))
    node = data
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return data


class Raw(str):
    """A token written into JSON as is (``NaN``, ``1e400``)."""


def _dump_json(node: Any) -> str:
    """JSON text of ``node``; a ``Raw`` is written verbatim, a ``Dup`` object repeats a key."""
    if isinstance(node, Raw):
        return str(node)
    if isinstance(node, Dup):
        return "{" + ", ".join(f"{json.dumps(k)}: {_dump_json(v)}" for k, v in node.pairs) + "}"
    if isinstance(node, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_dump_json(v)}" for k, v in node.items()) + "}"
    if isinstance(node, list):
        return "[" + ", ".join(_dump_json(v) for v in node) + "]"
    return json.dumps(node)


class Dup:
    """An object written with one key twice."""

    def __init__(self, node: dict, key: str) -> None:
        self.pairs = [*node.items(), (key, node[key])]


def _leaves(data: Any, kind: str) -> list[tuple[Path_, Any]]:
    free = FREE_FORM.get(kind, ())
    return [(p, v) for p, v in _walk(data) if not isinstance(v, (dict, list))
            and not any(_dotted(p).startswith(f) for f in free)]


def _numeric_leaves(data: Any, kind: str) -> list[tuple[Path_, Any]]:
    skip = NO_RANGE.get(kind, set())
    return [(p, v) for p, v in _leaves(data, kind) if isinstance(v, (int, float)) and not isinstance(v, bool)
            and not {str(k) for k in p} & skip]


def _required_keys(data: Any, kind: str) -> list[Path_]:
    optional = OPTIONAL[kind]
    return [p for p, _ in _walk(data) if not isinstance(p[-1], int) and _dotted(p) not in optional
            and p[-1] not in optional and not any(_dotted(p).startswith(f + ".") for f in FREE_FORM.get(kind, ()))]


def _objects(data: Any, kind: str) -> list[Path_]:
    """Paths of the objects whose keys are a fixed set (the root is ``()``)."""
    free = FREE_FORM.get(kind, ())
    root = [()] if isinstance(data, dict) else []
    return root + [p for p, v in _walk(data) if isinstance(v, dict) and v and _dotted(p) not in free]


def _get(data: Any, path: Path_) -> Any:
    for key in path:
        data = data[key]
    return data


# ---------------------------------------------------------------- mutations
NOT_A_NUMBER = ["x", True, None, [], {}, [1], {"a": 1}]
NOT_A_STRING = [1, 2.5, True, None, [], {}, ["a"]]
NOT_A_BOOL = [0, 1, "true", None, [], {}]
HUGE_INTS = [10**30, -(10**30), 10**400, 2**63]
HUGE_FLOATS = [Raw("1e400"), Raw("-1e400"), 10**400]
NON_FINITE = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity")]
DEEP = [json.loads("[" * n + "]" * n) for n in (65, 100, 200)]


JSON_OPS = ["drop", "wrong_type", "range", "huge", "non_finite", "duplicate", "unknown_key", "deep", "truncate",
            "utf8", "random"]


@st.composite
def json_mutation(draw: Any, kind: str, base: Any, op: str) -> tuple[str, str]:
    """(``op``, JSON text) of ``base`` (kind ``kind``) damaged in one place by ``op`` (one of ``JSON_OPS``)."""
    if op == "drop":
        return op, _dump_json(_drop(base, draw(st.sampled_from(_required_keys(base, kind)))))
    if op == "wrong_type":
        path, value = draw(st.sampled_from(_leaves(base, kind)))
        pool = NOT_A_BOOL if isinstance(value, bool) else NOT_A_STRING if isinstance(value, str) else NOT_A_NUMBER
        return op, _dump_json(_replace(base, path, draw(st.sampled_from(pool))))
    if op == "range":
        path, value = draw(st.sampled_from(_numeric_leaves(base, kind)))
        zero_ok = {str(k) for k in path} & ZERO_OK[kind]
        return op, _dump_json(_replace(base, path, draw(st.sampled_from([-1, -0.5] if zero_ok else [0, -1, 0.0]))))
    if op == "huge":
        path, value = draw(st.sampled_from(_numeric_leaves(base, kind)))
        pool = HUGE_INTS if type(value) is int else HUGE_FLOATS  # a float field takes ints: 10**30 is valid there
        return op, _dump_json(_replace(base, path, draw(st.sampled_from(pool))))
    if op == "non_finite":
        path, _ = draw(st.sampled_from(_leaves(base, kind)))
        return op, _dump_json(_replace(base, path, draw(st.sampled_from(NON_FINITE))))
    if op == "duplicate":
        path = draw(st.sampled_from(_objects(base, kind)))
        node = _get(base, path)
        key = draw(st.sampled_from(sorted(node)))
        return op, _dump_json(_replace(base, path, Dup(node, key)) if path else Dup(base, key))
    if op == "unknown_key":
        path = draw(st.sampled_from(_objects(base, kind)))
        name = draw(st.sampled_from(["typo", "nodes_", "Version", "", "\u00e9"]))
        node = {**_get(base, path), name: 1}
        return op, _dump_json(_replace(base, path, node) if path else node)
    if op == "deep":
        path, _ = draw(st.sampled_from(_walk(base)))
        return op, _dump_json(_replace(base, path, draw(st.sampled_from(DEEP))))
    text = _dump_json(base)
    if op == "truncate":  # a prefix of an object lacks its closing brace: never valid JSON
        return op, text[:draw(st.integers(0, len(text) - 1))]
    if op == "utf8":
        return op, _insert_bad_byte(draw, text)
    return op, draw(_random_bytes(kind))


def _insert_bad_byte(draw: Any, text: str) -> bytes:
    """``text`` (ASCII) with one byte that is never valid UTF-8 there, at any offset."""
    raw = text.encode()
    at = draw(st.integers(0, len(raw)))
    bad = draw(st.sampled_from([b"\xff", b"\xfe", b"\xc0", b"\x80", b"\xe9", b"\xed\xa0\x80"]))
    return raw[:at] + bad + raw[at:]


def _random_bytes(kind: str) -> st.SearchStrategy:
    """Random bytes that are not a mapping (JSON/YAML) or, for metrics, not lines of flat objects: bytes
    that happen to parse as one are a (tiny) valid file, not what this operation tests."""
    def parses(text: str) -> bool:
        try:
            value = yaml.safe_load(text) if kind == "cluster_yaml" else json.loads(text)
        except Exception:  # any parse error: the strict readers refuse it too
            return False
        return isinstance(value, dict) and not any(isinstance(v, (dict, list)) for v in value.values())

    def bad(data: bytes) -> bool:
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return True
        if kind != "metrics":
            return not parses(text)
        rows = [line for line in text.splitlines() if line.strip()]
        return not rows or not all(parses(line) for line in rows)

    return st.binary(min_size=1, max_size=300).filter(bad)


# ------------------------------------------------------------------ the runner


def _record(kind: str, data: str | bytes, op: str = "") -> None:
    digest = hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()
    if digest not in CORPUS[kind]:
        CORPUS[kind].add(digest)
        OPS[kind, op] += 1


def refused(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI; assert exit 2, one stderr line with ``PREFIX`` and ``needles``, no traceback, in time."""
    capsys.readouterr()
    start = time.monotonic()
    with no_hang(int(CASE_SECONDS) * 4):
        code = main(argv)
    seconds = time.monotonic() - start
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2, f"exit {code} for {argv}: stdout {out[-300:]!r} stderr {err[-300:]!r}"
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert "Traceback" not in err and "Traceback" not in out, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert seconds < CASE_SECONDS, f"{argv} took {seconds:.1f} s"
    return lines[0]


@pytest.fixture(scope="module", autouse=True)
def warm_imports(tmp_path_factory):
    """Import what the commands import on first use, so a case's wall time is the reader's, not imports'."""
    import matplotlib.pyplot  # noqa: F401  (autoshard plot)

    import autoshard.calibrate  # noqa: F401
    import autoshard.cli_search  # noqa: F401
    import autoshard.runtime.launch  # noqa: F401
    import autoshard.runtime.ppo_program  # noqa: F401

    good = Plan.from_dict(PLAN).save(tmp_path_factory.mktemp("warm") / "good.json")
    with contextlib.redirect_stdout(None):
        assert main(["inspect", str(good)]) == 0 and main(["diff", str(good), str(good)]) == 0


@pytest.fixture
def no_work(monkeypatch):
    """Any model capture, calibration measurement or PPO model build is a failure: a bad input got past."""
    def accepted(*args, **kwargs):
        raise AssertionError("the bad input was accepted: work started")

    monkeypatch.setattr("autoshard.cli_search.capture_model", accepted)
    monkeypatch.setattr("autoshard.runtime.ppo_program.load_policy", accepted)
    monkeypatch.setattr("autoshard.calibrate.calibrate", accepted)
    monkeypatch.setattr("autoshard.cluster.Cluster.detect", accepted)


@pytest.fixture
def work(tmp_path):
    """A directory with a valid plan, a script and bad-path targets (a FIFO, a directory, a plain file)."""
    Plan.from_dict(PLAN).save(tmp_path / "good.json")
    (tmp_path / "train.py").write_text("print('ran')\n")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("")
    return tmp_path


def _write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


# --------------------------------------------------------------- plan files
def _plan_commands(work: Path, bad: Path, variant: int) -> list[str]:
    good, script = str(work / "good.json"), str(work / "train.py")
    return [
        ["inspect", str(bad)],
        ["diff", str(bad), good],
        ["diff", good, str(bad)],
        ["run", str(bad), "--dry-run", "--", script],
        ["plan", "--cluster", "cpu:1x2", "--plan", str(bad)],
        ["explain", str(bad), "--layer", "a"],
    ][variant]


@pytest.mark.parametrize("op", JSON_OPS)
@examples(10)
@given(data=st.data(), variant=st.integers(0, 5))
def test_fuzz_plan_files(capsys, work, no_work, op, data, variant):
    op, data = data.draw(json_mutation("plan", PLAN, op))
    _record("plan", data, op)
    bad = _write(work / "bad.json", data)
    refused(capsys, _plan_commands(work, bad, variant), "bad.json")


# ------------------------------------------------------------ cluster files
def _cluster_yaml(data: Any) -> str:
    """YAML text with ``nodes: 1`` last: any proper prefix then lacks or cuts a required key."""
    data = dict(data)
    nodes = data.pop("nodes", None)
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return text + (f"nodes: {nodes}\n" if nodes is not None else "")


YAML_OPS = ["drop", "wrong_type", "range", "huge", "unknown_key", "deep", "duplicate_line", "alias", "non_finite",
            "truncate", "utf8", "random", "tab"]


@st.composite
def yaml_mutation(draw: Any, op: str) -> tuple[str, str]:
    """(``op``, YAML text) of the cluster damaged in one place by operation ``op`` (one of ``YAML_OPS``)."""
    if op in YAML_OPS[:6]:  # the data-level mutations, written as YAML
        _, text = draw(json_mutation("cluster", CLUSTER, op))
        return op, _cluster_yaml(json.loads(text))
    text = _cluster_yaml(CLUSTER)
    lines = text.splitlines(keepends=True)
    scalars = [i for i, line in enumerate(lines) if ": " in line]
    if op == "duplicate_line":
        i = draw(st.sampled_from(range(len(lines))))
        return op, "".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])
    if op == "alias":
        i = draw(st.sampled_from(scalars[:-1]))
        j = draw(st.sampled_from([k for k in scalars if k > i]))
        anchored = lines[i].replace(": ", ": &a ", 1)
        aliased = lines[j].split(": ", 1)[0] + ": *a\n"
        return op, "".join(lines[:i] + [anchored] + lines[i + 1:j] + [aliased] + lines[j + 1:])
    if op == "non_finite":
        i = draw(st.sampled_from(scalars))
        token = draw(st.sampled_from([".nan", ".inf", "-.inf", ".NaN"]))
        return op, "".join(lines[:i] + [lines[i].split(": ", 1)[0] + f": {token}\n"] + lines[i + 1:])
    if op == "truncate":
        return op, text.rstrip("\n")[:draw(st.integers(0, len(text.rstrip("\n")) - 1))]
    if op == "utf8":
        return op, _insert_bad_byte(draw, text)
    if op == "tab":  # YAML forbids tabs as indentation
        i = draw(st.sampled_from([k for k, line in enumerate(lines) if line.startswith("  ")]))
        return op, "".join(lines[:i] + ["\t" + lines[i].lstrip(" ")] + lines[i + 1:])
    return op, draw(_random_bytes("cluster_yaml"))


def _cluster_command(path: Path, variant: int) -> list[str]:
    if variant == 0:
        return ["cluster", "show", str(path)]
    return ["plan", "llama:tiny", "--cluster", str(path), "--batch", "2", "--seq", "8"]


@pytest.mark.parametrize("op", JSON_OPS)
@examples(6)
@given(data=st.data(), variant=st.integers(0, 1))
def test_fuzz_cluster_json(capsys, work, no_work, op, data, variant):
    op, data = data.draw(json_mutation("cluster", CLUSTER, op))
    _record("cluster_json", data, op)
    bad = _write(work / "bad.json", data)
    refused(capsys, _cluster_command(bad, variant), "cluster file", "bad.json")


@pytest.mark.parametrize("op", YAML_OPS)
@examples(5)
@given(data=st.data(), variant=st.integers(0, 1))
def test_fuzz_cluster_yaml(capsys, work, no_work, op, data, variant):
    op, data = data.draw(yaml_mutation(op))
    _record("cluster_yaml", data, op)
    bad = _write(work / "bad.yaml", data)
    refused(capsys, _cluster_command(bad, variant), "cluster file", "bad.yaml")


# -------------------------------------------------------- calibration files
@pytest.mark.parametrize("op", JSON_OPS)
@examples(5)
@given(data=st.data())
def test_fuzz_calibration_files(tmp_path, op, data):
    op, data = data.draw(json_mutation("calibration", CALIBRATION, op))
    _record("calibration", data, op)
    bad = _write(tmp_path / "bad.json", data)
    start = time.monotonic()
    with no_hang(int(CASE_SECONDS) * 4), pytest.raises(AutoshardError) as info:
        Cluster.parse("cpu:1x2").with_calibration(bad)
    message = str(info.value)
    assert "\n" not in message and "calibration file" in message and "bad.json" in message, message
    assert "cluster file" not in message, message
    assert time.monotonic() - start < CASE_SECONDS


def test_calibration_base_is_valid():
    """The base the calibration mutations start from is accepted (so each mutation is what is refused)."""
    applied = Cluster.parse("cpu:1x2").with_calibration(CALIBRATION)
    assert applied.calibration["kernel_overhead_s"] == 8e-6


# ------------------------------------------------------------ metrics files
METRICS_OPS = ["nested", "not_object", "non_finite", "duplicate", "deep", "truncate", "utf8", "random", "empty"]


@st.composite
def metrics_mutation(draw: Any, op: str) -> tuple[str, str | bytes]:
    """(``op``, JSON-lines text) of the metrics damaged in one row by operation ``op`` (one of ``METRICS_OPS``)."""
    rows = [dict(row) for row in METRICS]
    i = draw(st.integers(0, len(rows) - 1))
    key = draw(st.sampled_from(sorted(rows[i])))
    lines = [_dump_json(row) for row in rows]
    if op == "nested":
        lines[i] = _dump_json({**rows[i], key: draw(st.sampled_from([[], {}, [1.0], {"a": 1}]))})
    elif op == "not_object":
        lines[i] = _dump_json(draw(st.sampled_from([[1, 2], 3, "row", None, True, []])))
    elif op == "non_finite":
        lines[i] = _dump_json({**rows[i], key: draw(st.sampled_from(NON_FINITE))})
    elif op == "duplicate":
        lines[i] = _dump_json(Dup(rows[i], key))
    elif op == "deep":
        lines[i] = _dump_json({**rows[i], key: draw(st.sampled_from(DEEP))})
    elif op == "truncate":  # cut inside a row (a cut at a line end would only drop rows)
        lines = lines[:i + 1]
        lines[i] = lines[i][:draw(st.integers(1, len(lines[i]) - 1))]
    elif op == "utf8":
        return op, _insert_bad_byte(draw, "\n".join(lines) + "\n")
    elif op == "random":
        return op, draw(_random_bytes("metrics"))
    else:  # no rows at all
        return op, draw(st.sampled_from(["", "\n", "\n\n  \n", " "]))
    return op, "\n".join(lines) + "\n"


@pytest.mark.parametrize("op", METRICS_OPS)
@examples(5)
@given(data=st.data())
def test_fuzz_metrics_files(capsys, work, op, data):
    op, data = data.draw(metrics_mutation(op))
    _record("metrics", data, op)
    bad = _write(work / "bad.jsonl", data)
    refused(capsys, ["plot", str(bad), "-o", str(work / "out.png")], "metrics file", "bad.jsonl")
    assert not (work / "out.png").exists()


# ------------------------------------------------- output paths, ppo flags
def _bad_output(work: Path, choice: str) -> str:
    return {"dev": "/dev/full", "dir": str(work / "dir"), "fifo": str(work / "fifo"), "empty": "",
            "under_file": str(work / "file" / "x.out"), "slash": str(work / "dir") + "/"}[choice]


BAD_OUTPUTS = ["dev", "dir", "fifo", "empty", "under_file", "slash"]


def ppo_flags(work: Path) -> dict[str, st.SearchStrategy]:
    """Name → strategy of (extra ``autoshard ppo`` flags, a word the error line must hold): what the parent checks."""
    target = st.sampled_from(BAD_OUTPUTS).map(lambda choice: _bad_output(work, choice))
    metrics = str(work / "m.jsonl")
    return {
        "metrics": target.map(lambda t: (["--metrics", t], "cannot write --metrics file")),
        "plot": target.map(lambda t: (["--metrics", metrics, "--plot", t], "cannot write --plot file")),
        "plot_alone": st.just((["--plot", str(work / "c.png")], "--plot")),
        "resume": st.just((["--resume"], "--resume")),
        "save_every": st.just((["--save-every", "2"], "--save-every")),
        "checkpoint": st.sampled_from(["file", "fifo"]).map(lambda n: (["--checkpoint", str(work / n)],
                                                                       "--checkpoint")),
        "steps": st.sampled_from(["0", "-1", "x", "1e9.5", ""]).map(lambda v: (["--steps", v], "--steps")),
        "batch": st.sampled_from(["0", "-4", "two", "9" * 30 + "x"]).map(lambda v: (["--batch", v], "--batch")),
        "task": st.sampled_from(["nope", "", "arith metic"]).map(lambda v: (["--task", v], "task")),
        "precision": st.sampled_from(["fp64", "", "BF16x"]).map(lambda v: (["--precision", v], "--precision")),
        "seed": st.sampled_from(["1.5", "x", ""]).map(lambda v: (["--seed", v], "--seed")),
        "unknown": st.sampled_from(["--no-such-flag", "--metrcs"]).map(lambda v: ([v], "unrecognized")),
    }


PPO_CASES = ["metrics", "plot", "plot_alone", "resume", "save_every", "checkpoint", "steps", "batch", "task",
             "precision", "seed", "unknown"]


@pytest.mark.parametrize("case", PPO_CASES)
@examples(4)
@given(data=st.data())
def test_fuzz_ppo_flags_refused_before_work(capsys, work, no_work, case, data):
    flags, needle = data.draw(ppo_flags(work)[case])
    _record("ppo", json.dumps(flags), case)
    refused(capsys, ["ppo", "llama:tiny", "--cluster", "cpu:1x2", *flags], needle)


@examples(15)
@given(flag=st.sampled_from(["--out", "--raw"]), choice=st.sampled_from(BAD_OUTPUTS))
def test_fuzz_calibrate_output_checked_before_measuring(capsys, work, no_work, flag, choice):
    target = _bad_output(work, choice)
    _record("calibrate", f"{flag} {choice}", flag)
    extra = [] if flag == "--out" else ["--out", str(work / "cal.json")]
    refused(capsys, ["cluster", "calibrate", "--quick", *extra, flag, target], "cannot write calibration file")


# ------------------------------------------------------ hand-written cases
SPECIAL_CLUSTERS = {  # name: (text, needle)
    "world.yaml": ("preset: cpu\nnodes: 2048\ndevices_per_node: 1024\n", "more than 1048576 (2**20) ranks"),
    "world.json": ('{"preset": "h100", "nodes": 1048576, "devices_per_node": 8}', "more than 1048576"),
    "digits.yaml": ("preset: cpu\nnodes: " + "1" * 5000 + "\n", "invalid YAML"),
    "float_int.yaml": ("preset: cpu\nnodes: 1.5\n", "nodes=1.5"),
    "int.yaml": ("preset: cpu\ndevice: {memory_bytes: 1000000000000000000000}\n", "more than 2**63 - 1"),
    "bytes.yaml": ("preset: cpu\ndevice: {memory_bytes: 1e30 TB}\n", "at most 2**63 - 1 bytes"),
    "huge_int.json": ('{"preset": "cpu", "host_bandwidth": ' + "9" * 400 + "}", "more than 2**63 - 1"),
    "bad_date.yaml": ("preset: cpu\nname: 2025-13-45\n", "invalid YAML"),
    "object.yaml": ("preset: !!python/object:os.system {}\n", "invalid YAML"),
    "merge.yaml": ("base: &b {nodes: 1}\n<<: *b\n", "alias *b is not accepted"),
    "list.yaml": ("- preset: cpu\n", "expected a mapping at the top level"),
    "bom.json": ("\ufeff{\"preset\": \"cpu\"}", "cluster file"),
    "nul.yaml": ("preset: cpu\x00\n", "cluster file"),
    "unit.yaml": ("preset: cpu\nhost_bandwidth: 10us\n", "host_bandwidth='10us'"),
    "preset.yaml": ("preset: [cpu]\n", "unknown cluster preset"),
}


@pytest.mark.parametrize("name", list(SPECIAL_CLUSTERS))
def test_special_cluster_files(capsys, work, no_work, name):
    text, needle = SPECIAL_CLUSTERS[name]
    bad = _write(work / name, text)
    refused(capsys, ["cluster", "show", str(bad)], name, needle)


SPECIAL_PLANS = {
    "int64": (lambda d: d.update(global_batch=2**63), "outside the 64-bit integer range"),
    "float_overflow": (lambda d: d["predictions"].update(step_time_s=10**400), "is not finite"),
    "mesh_float": (lambda d: d["mesh"].update(tp=2.0), "mesh.tp: expected int"),
    "version": (lambda d: d.update(version=2), "plan version 2 is not supported"),
    "bool_int": (lambda d: d.update(seq_len=True), "seq_len: expected int"),
    "stage": (lambda d: d["layers"][1].update(stage=1), "layers[1].stage"),
    "repeat": (lambda d: d["layers"][1].update(layer="a"), "repeats layers[0]"),
    "format": (lambda d: d.update(format="autoshard.cluster"), "not an autoshard plan"),
}


@pytest.mark.parametrize("name", list(SPECIAL_PLANS))
def test_special_plan_files(capsys, work, name):
    edit, needle = SPECIAL_PLANS[name]
    data = json.loads(json.dumps(PLAN))
    edit(data)
    bad = _write(work / "bad.json", _dump_json(data))
    refused(capsys, ["inspect", str(bad)], "bad.json", needle)


@pytest.mark.parametrize("text, needle", [
    ('{"layer_times": {"model": "m", "dtype": "fp32", "seq_len": 8, "samples": {"a": 1}}}', "samples"),
    ('{"layer_times": {"model": "m", "dtype": "fp32", "seq_len": 8, "samples": 3}}', "samples"),
    ('{"kernel_overhead_s": "fast"}', "kernel_overhead_s"),
    ('{"attention_efficiency": 3}', "must be in (0, 1]"),
    ('{"date": [2025, 1, 31]}', "calibration.date"),
    ('{"layer_times": {"model": "m", "dtype": "fp32", "seq_len": 8, "samples": [{"signature": "s", "layer": "l", '
     '"tp": "2", "tokens": 8, "fwd_s": 1, "bwd_s": 1}]}}', "samples[0].tp='2'"),
    ('{"overlap_contention": -0.1}', "must be in [0, 1]"),
    ("[]", "expected a mapping at the top level"),
    ("", "invalid JSON"),
])
def test_special_calibration_files(tmp_path, text, needle):
    bad = _write(tmp_path / "cal.json", text)
    with pytest.raises(AutoshardError) as info:
        Cluster.parse("cpu:1x2").with_calibration(bad)
    message = str(info.value)
    assert "\n" not in message and f"calibration file {str(bad)!r}" in message and needle in message, message


def test_ppo_outputs_checked_before_any_work(capsys, work, no_work):
    """The leftovers of docs/reliability.md: ``--plot`` and ``--metrics`` are checked in the parent."""
    refused(capsys, ["ppo", "llama:tiny", "--cluster", "cpu:1x2", "--metrics", str(work / "m.jsonl"),
                     "--plot", "/dev/full"], "cannot write --plot file '/dev/full'", "character device")
    refused(capsys, ["ppo", "llama:tiny", "--cluster", "cpu:1x2", "--metrics", str(work / "dir")],
            "cannot write --metrics file", "a directory")


def test_calibrate_writes_atomically(work):
    """``cluster calibrate --out`` creates missing parents and writes through ``file_io.atomic_write``."""
    from autoshard import calibrate

    class Measured:  # what _write reads of a Calibration
        device, link_level, layer_times = "CPU core", None, None
        matmul_efficiency = hbm_efficiency = attention_efficiency = 0.5
        kernel_overhead_s = gemm_knee_flops = adamw_s_per_param = adamw_s_per_tensor = 1e-6

        def to_file_dict(self):
            return {"device": self.device, "matmul_efficiency": self.matmul_efficiency}

    out = work / "new" / "cal.json"
    calibrate._write(calibrate.argparse.Namespace(out=out, raw=None), Measured(), None)
    assert json.loads(out.read_text()) == {"device": "CPU core", "matmul_efficiency": 0.5}
    assert [p.name for p in out.parent.iterdir()] == ["cal.json"]  # no temporary file left
    assert Cluster.parse("cpu:1x2").with_calibration(out).device.matmul_efficiency == 0.5


# ------------------------------------------------------------------ the size
def test_corpus_size():
    """At least 200 distinct generated inputs ran (when the whole file runs)."""
    kinds = {"plan", "cluster_json", "cluster_yaml", "calibration", "metrics", "ppo", "calibrate"}
    if set(CORPUS) != kinds:
        pytest.skip("only part of the file ran")
    counts = {kind: len(CORPUS[kind]) for kind in sorted(kinds)}
    assert sum(counts.values()) >= 200, counts
    print("\nfuzz corpus:", counts, dict(sorted(OPS.items())))  # shown with -s
