"""``autoshard/file_io.py`` and its readers and writers: special files, size limits, UTF-8, nesting,
duplicate keys, missing fields and out-of-range numbers are refused with one line, through the
Python API and through the CLI (exit 2, one stderr line, no traceback), and never hang or recurse."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _harness import no_hang
from autoshard import file_io
from autoshard.cli import main
from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError, ClusterError, PlanError
from autoshard.file_io import FileKind, atomic_write, check_output_path, parse_json_strict, parse_yaml_strict
from autoshard.plan import LayerStrategy, Mesh, Plan
from autoshard.runtime._checkpoint_files import CheckpointError, CheckpointInfo
from autoshard.runtime.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
DEEP = 10_000
SMALL = FileKind("test file", 64, AutoshardError, "next step")




def _plan() -> Plan:
    return Plan("m", Mesh(dp_shard=2), (LayerStrategy("a"), LayerStrategy("b", state="zero3")), global_batch=4,
                seq_len=8)


@pytest.fixture
def files(tmp_path):
    """Bad inputs: a FIFO, a symlink to /dev/zero, a directory and a symlink to it, non-UTF-8 bytes."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    directory = tmp_path / "dir.json"
    directory.mkdir()
    dir_link = tmp_path / "dir_link.json"
    dir_link.symlink_to(directory)
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"model_name": "caf\xe9"}')
    return {"fifo": fifo, "zero": zero, "dir": directory, "dir_link": dir_link, "latin1": latin1}


SPECIAL = [("fifo", "FIFO"), ("zero", "character device"), ("dir", "a directory"), ("dir_link", "a directory")]


# ---------------------------------------------------------------- reading
@pytest.mark.parametrize("name, what", SPECIAL)
def test_special_files_are_refused_without_reading(files, name, what):
    with no_hang():
        with pytest.raises(AutoshardError, match=f"cannot read test file .*{name}.json.*{what}.*; next step"):
            file_io.read_bounded_text(files[name], SMALL)


def test_missing_empty_large_and_non_utf8(tmp_path, files):
    with pytest.raises(AutoshardError, match="it does not exist"):
        file_io.read_bounded_text(tmp_path / "nope.json", SMALL)
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nope.json")
    with pytest.raises(AutoshardError, match="symbolic link to a missing file"):
        file_io.read_bounded_text(tmp_path / "dangling.json", SMALL)
    with pytest.raises(AutoshardError, match="the path is empty"):
        file_io.read_bounded_text("", SMALL)
    (tmp_path / "big.json").write_text("x" * 65)
    with pytest.raises(AutoshardError, match="65 bytes is over the 0 MiB limit"):
        file_io.read_bounded_text(tmp_path / "big.json", SMALL)
    (tmp_path / "ok.json").write_text("x" * 64)
    assert file_io.read_bounded_text(tmp_path / "ok.json", SMALL) == "x" * 64
    with pytest.raises(AutoshardError, match=r"not UTF-8 text \(byte 0xe9 at offset 19\)"):
        file_io.read_bounded_text(files["latin1"], SMALL)


def test_limits_are_written_down():
    assert (file_io.PLAN_FILE.max_bytes, file_io.CLUSTER_FILE.max_bytes, file_io.METRICS_FILE.max_bytes) == (
        16 * 2**20, 16 * 2**20, 256 * 2**20)
    assert (file_io.MAX_DEPTH, file_io.MAX_WORLD_SIZE) == (64, 2**20)


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP,
                                  "[" * 65 + "]" * 65])
def test_deep_json_is_refused(text):
    with pytest.raises(AutoshardError, match="nested deeper than 64 levels"):
        parse_json_strict(text, source="s", kind=SMALL)


def test_json_at_the_depth_limit_and_other_strictness():
    assert parse_json_strict("[" * 64 + "]" * 64, source="s", kind=SMALL) is not None
    with pytest.raises(AutoshardError, match="s: duplicate key 'a' in one object"):
        parse_json_strict('{"b": {"a": 1, "a": 2}}', source="s", kind=SMALL)
    with pytest.raises(AutoshardError, match="NaN is not standard JSON"):
        parse_json_strict('{"a": NaN}', source="s", kind=SMALL)
    with pytest.raises(AutoshardError, match="s: invalid JSON: .*digit"):  # over Python's int digit limit
        parse_json_strict("1" * 5000, source="s", kind=SMALL)
    with pytest.raises(AutoshardError, match="s: not UTF-8 text"):
        parse_json_strict(b'"\xff"', source="s", kind=SMALL)


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, "".join(f"{' ' * i}k{i}:\n" for i in range(200)) + "x",
                                  "a: " + "{b: " * DEEP + "1" + "}" * DEEP])
def test_deep_yaml_is_refused(text):
    with pytest.raises(AutoshardError, match="nested deeper than 64 levels"):
        parse_yaml_strict(text, source="s", kind=SMALL)


def test_yaml_duplicate_keys_and_aliases():
    with pytest.raises(AutoshardError, match="s: line 3: duplicate key 'nodes'"):
        parse_yaml_strict("preset: cpu\nnodes: 1\nnodes: 2\n", source="s", kind=SMALL)
    with pytest.raises(AutoshardError, match="duplicate key 'b'"):
        parse_yaml_strict("a: {b: 1, b: 2}\n", source="s", kind=SMALL)
    with pytest.raises(AutoshardError, match=r"alias \*x is not accepted"):
        parse_yaml_strict("a: &x [1, 2]\nb: *x\n", source="s", kind=SMALL)
    assert parse_yaml_strict("a: [1, {b: 2}]\n", source="s", kind=SMALL) == {"a": [1, {"b": 2}]}


def test_load_helpers_read_then_parse(tmp_path, files):
    (tmp_path / "a.json").write_text('{"a": [1]}')
    (tmp_path / "a.yaml").write_text("a: [1]\n")
    assert file_io.load_json_strict(tmp_path / "a.json", SMALL) == file_io.load_yaml_strict(tmp_path / "a.yaml", SMALL)
    with no_hang(), pytest.raises(AutoshardError, match="FIFO"):
        file_io.load_yaml_strict(files["fifo"], SMALL)
    (tmp_path / "b.yaml").write_text("a: 1\na: 2\n")
    with pytest.raises(AutoshardError, match="test file '.*b.yaml': line 2: duplicate key 'a'"):
        file_io.load_yaml_strict(tmp_path / "b.yaml", SMALL)


# ------------------------------------------------------------------ plans
def _write_plan(tmp_path, edit=None, raw=None) -> Path:
    data = _plan().to_dict()
    if edit:
        edit(data)
    path = tmp_path / "p.json"
    path.write_text(raw if raw is not None else json.dumps(data))
    return path


BAD_PLANS = {
    "deep": (None, '{"format": "autoshard.plan", "x": ' + "[" * DEEP + "]" * DEEP + "}", "nested deeper than 64"),
    "duplicate": (None, '{"format": "autoshard.plan", "version": 1, "version": 1}', "duplicate key 'version'"),
    "no_global_batch": (lambda d: d.pop("global_batch"), None, "global_batch: missing (required field)"),
    "no_fingerprints": (lambda d: d.pop("fingerprints"), None, "fingerprints: missing (required field)"),
    "no_mesh_axis": (lambda d: d["mesh"].pop("tp"), None, "mesh.tp: missing (required field)"),
    "huge_mesh": (lambda d: d["mesh"].update(dp_shard=2**30), None, "mesh: world size"),
    "zero_mesh": (lambda d: d["mesh"].update(tp=0), None, "mesh.tp: 0 must be >= 1"),
    "negative_memory": (lambda d: d["predictions"].update(memory_by_stage=[5, -1]), None,
                        "predictions.memory_by_stage[1]: -1 bytes: must be >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plans_are_refused(tmp_path, case):
    edit, raw, needle = BAD_PLANS[case]
    path = _write_plan(tmp_path, edit, raw)
    with pytest.raises(PlanError, match=re.escape(needle)) as info:
        Plan.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name, what", [*SPECIAL, ("latin1", "not UTF-8")])
def test_plan_load_refuses_special_and_non_utf8_files(files, name, what):
    with no_hang(), pytest.raises(PlanError, match=f"cannot read plan file .*{what}"):
        Plan.load(files[name])


def test_plans_this_version_and_older_files_still_load(tmp_path):
    plan = _plan()
    assert Plan.load(plan.save(tmp_path / "p.json")) == plan
    recorded = Plan.load(REPO / "benchmarks/results/ppo_llama350m_h100x2_2026-11-26.plan.json")  # no caveats
    assert recorded.predictions.caveats == () and recorded.predictions.build_peak_bytes == 0


# --------------------------------------------------------------- clusters
CLUSTER_YAML = "preset: cpu\ndevices_per_node: 2\n"
BAD_CLUSTERS = {
    "c.yaml": ("a: " + "[" * DEEP + "]" * DEEP + "\n", "nested deeper than 64"),
    "d.json": ('{"preset": "cpu", ' + '"x": {' * DEEP + "}" * DEEP + "}", "nested deeper than 64"),
    "e.yaml": (CLUSTER_YAML + "devices_per_node: 4\n", "line 3: duplicate key 'devices_per_node'"),
    "f.json": ('{"preset": "cpu", "nodes": 1, "nodes": 2}', "duplicate key 'nodes'"),
    "g.yaml": (CLUSTER_YAML + "nodes: 1000000000000000000000000000000\n", "more than 1048576 (2**20) ranks"),
    "h.yaml": (CLUSTER_YAML + "host_bandwidth: 0\n", "host_bandwidth=0: must be a positive"),
    "i.yaml": (CLUSTER_YAML + "device: {memory_bytes: 0GiB}\n", "memory_bytes=0: must be a positive"),
    "j.yaml": (CLUSTER_YAML + "intra_node: {bandwidth: 0GB/s}\n", "bandwidth=0"),
}


@pytest.mark.parametrize("name", list(BAD_CLUSTERS))
def test_bad_cluster_files_are_refused(tmp_path, name):
    text, needle = BAD_CLUSTERS[name]
    (tmp_path / name).write_text(text)
    with pytest.raises(ClusterError, match=re.escape(needle)) as info:
        Cluster.from_file(tmp_path / name)
    assert name in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name, what", [*SPECIAL, ("latin1", "not UTF-8")])
def test_cluster_and_calibration_files_refuse_special_files(files, name, what):
    with no_hang(), pytest.raises(ClusterError, match=f"cannot read cluster file .*{what}"):
        Cluster.from_file(files[name])
    with no_hang(), pytest.raises(ClusterError, match=f"cannot read calibration file .*{what}"):
        Cluster.parse("cpu:1x2").with_calibration(files[name])


def test_preset_spec_world_size_is_bounded():
    with pytest.raises(ClusterError, match="more than 1048576"):
        Cluster.parse("cpu:2048x1024")
    with pytest.raises(ClusterError, match="must be an integer ≥ 1 and ≤ 2\\*\\*20"):
        Cluster.parse("cpu:1" + "0" * 30 + "x1")


# ------------------------------------------------------ metrics, sidecars
def test_metrics_are_read_strictly(tmp_path, files):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "reward/mean": null}\n\n{"step": 2, "reward/mean": 0.5}\n')
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["reward/mean"] != rows[0]["reward/mean"]
    for text, needle in [('{"step": 1, "step": 2}\n', "line 1: duplicate key 'step'"),
                         ('{"step": 1}\n[1, 2]\n', "line 2: expected one JSON object"),
                         ('{"step": 1}\n{"step": \n', "line 2: invalid JSON")]:
        path.write_text(text)
        with pytest.raises(AutoshardError, match=needle):
            read_metrics(path)
    with no_hang(), pytest.raises(AutoshardError, match="cannot read metrics file .*FIFO"):
        read_metrics(files["fifo"])


def _sidecar(**changes) -> str:
    data = {"format": "autoshard.checkpoint", "version": 1, "model_fingerprint": "f", "step": 3, "world_size": 2,
            "tensors": {"w": {"shape": [4, 2], "dtype": "float32"}}, "mesh": {"dp_shard": 2}}
    return json.dumps({**data, **changes})


def test_checkpoint_sidecar_is_read_strictly():
    assert CheckpointInfo.from_json(_sidecar(), source="s").world_size == 2
    for text, needle in [(_sidecar(world_size=10**30), "world_size=1000"), (_sidecar(world_size="2"), "world_size='2'"),
                         (_sidecar(step=-1), "step=-1"), (_sidecar(mesh={"dp_shard": 0}), "mesh\\['dp_shard'\\]=0"),
                         (_sidecar(step=True), "step=True"), ('{"step": 1, "step": 2}', "duplicate key 'step'"),
                         ("[" * DEEP + "]" * DEEP, "nested deeper than 64"), ("[]", "expected a JSON object")]:
        with pytest.raises(CheckpointError, match=needle):
            CheckpointInfo.from_json(text, source="s")


# ---------------------------------------------------------------- writing
@pytest.mark.parametrize("target, needle", [("/dev/full", "character device"), ("dir", "a directory"),
                                            ("fifo", "FIFO"), ("", "the path is empty"),
                                            ("missing/p.json", "does not exist"), ("file/p.json", "not a directory")])
def test_unwritable_outputs_are_refused(tmp_path, target, needle):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    path = target if target in ("", "/dev/full") else str(tmp_path / target)
    with no_hang(), pytest.raises(PlanError, match=f"cannot write plan file.*{needle}"):
        _plan().save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "fifo", "file"]  # nothing left behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_read_only_directory_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(PlanError, match="is not writable"):
        check_output_path(tmp_path / "ro" / "p.json", noun="plan file", error=PlanError)


def test_atomic_write_replaces_files_and_writes_through_symlinks(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert atomic_write(link, "new") == link
    assert link.is_symlink() and target.read_text() == "new"
    assert atomic_write(tmp_path / "a" / "b.png", b"\x89PNG", parents=True).read_bytes() == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "link.json", "real.json"]


# -------------------------------------------------------------------- CLI
def _one_line_error(capsys, *argv: str, needle: str) -> None:
    with no_hang():
        code = main(list(argv))
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("autoshard: error: ") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("name, needle", [("fifo", "FIFO"), ("zero", "character device"), ("dir", "a directory"),
                                          ("latin1", "not UTF-8")])
def test_cli_refuses_special_and_non_utf8_files(capsys, files, name, needle):
    path = str(files[name])
    _one_line_error(capsys, "inspect", path, needle=needle)
    _one_line_error(capsys, "diff", path, path, needle=needle)
    _one_line_error(capsys, "cluster", "show", path, needle=needle)
    _one_line_error(capsys, "plot", path, "-o", path + ".png", needle=needle)


@pytest.mark.parametrize("case", ["deep", "duplicate", "no_global_batch", "huge_mesh"])
def test_cli_refuses_bad_plans(capsys, tmp_path, case):
    edit, raw, needle = BAD_PLANS[case]
    _one_line_error(capsys, "inspect", str(_write_plan(tmp_path, edit, raw)), needle=needle)


@pytest.mark.parametrize("name", ["c.yaml", "e.yaml", "g.yaml"])
def test_cli_refuses_bad_cluster_files(capsys, tmp_path, name):
    text, needle = BAD_CLUSTERS[name]
    (tmp_path / name).write_text(text)
    _one_line_error(capsys, "cluster", "show", str(tmp_path / name), needle=needle)


@pytest.mark.parametrize("target, needle", [("/dev/full", "character device"), ("dir", "a directory"),
                                            ("", "the path is empty")])
def test_cli_plan_output_is_checked_before_the_search(capsys, tmp_path, monkeypatch, target, needle):
    def no_work(*args, **kwargs):
        raise AssertionError("the search started before the output path was checked")

    monkeypatch.setattr("autoshard.cli_search.capture_model", no_work)
    monkeypatch.setattr("autoshard.cluster.Cluster.load", no_work)
    (tmp_path / "dir").mkdir()
    out = target if target in ("", "/dev/full") else str(tmp_path / target)
    _one_line_error(capsys, "plan", "llama:tiny", "--cluster", "cpu:1x2", "--batch", "2", "--seq", "8",
                    "-o", out, needle=needle)


def test_cli_plot_output_is_checked(capsys, tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1}\n')
    _one_line_error(capsys, "plot", str(metrics), "-o", "/dev/full", needle="cannot write plot '/dev/full'")


@pytest.mark.slow
def test_cli_subprocess_fifo_does_not_hang(files):
    result = subprocess.run([sys.executable, "-m", "autoshard.cli", "inspect", str(files["fifo"])],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "FIFO" in result.stderr
