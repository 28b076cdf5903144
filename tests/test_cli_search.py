"""``autoshard plan / explain / diff``, in process: the plan workflow end to end
(plan → save → inspect → explain → diff, ``--plan`` reuse without a search,
``--retarget`` to a larger cluster), user constraints (``--pin`` globs,
``--mesh``, ``--max-memory``) reaching the plan, and every bad input as one
line on stderr with exit code 2.

Captures are memoised per model for the whole file (``_cached_capture``): the
first ``plan`` of a model pays for ``torch.export``, later ones reuse it.
"""

from __future__ import annotations

import importlib
import io
import json
import re

import pytest

import autoshard.search as search
from autoshard.cli import main
from autoshard.plan import MESH_AXES, Plan

capture_module = importlib.import_module("autoshard.passes.capture")  # the package re-exports a function of that name
TINY = ("--batch", "16", "--seq", "128")
_GRAPHS: dict[str, object] = {}
_REAL_CAPTURE = capture_module.capture_reference


def _cached_capture(spec: str, **options):
    assert not options, options  # the CLI captures reference models with default options
    if spec not in _GRAPHS:
        _GRAPHS[spec] = _REAL_CAPTURE(spec)
    return _GRAPHS[spec]


@pytest.fixture(autouse=True)
def _memoised_capture(monkeypatch):
    monkeypatch.setattr(capture_module, "capture_reference", _cached_capture)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _ok(capsys, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 0 and err == "", err
    return out


def _one_line_error(capsys, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2, (code, out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoshard: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def gpt_plans(tmp_path_factory):
    """gpt:tiny planned for 1x8 and for 2x8 (paths), made once for the module."""
    folder = tmp_path_factory.mktemp("plans")
    paths = {}
    for spec in ("h100-sxm:1x8", "h100-sxm:2x8"):
        paths[spec] = folder / f"{spec.replace(':', '_')}.json"
        assert main(["plan", "gpt:tiny", "--cluster", spec, *TINY, "-o", str(paths[spec])]) == 0
    return paths


# ---------------------------------------------------------------- workflow
@pytest.mark.slow
def test_plan_prints_the_plan_and_writes_it(capsys, tmp_path):
    out = _ok(capsys, "plan", "llama:tiny", "--cluster", "h100-sxm:1x8", *TINY, "-o", str(tmp_path / "p.json"))
    plan = Plan.load(tmp_path / "p.json")
    assert plan.model_name == "llama:tiny" and plan.mesh.world_size == 8
    assert (plan.global_batch, plan.seq_len, plan.optimizer, plan.precision) == (16, 128, "adamw", "bf16")
    assert str(plan.mesh).split(" (world")[0] in out  # the printed plan is the saved one
    assert re.search(r"search \d+\.\d s", out) and plan.solver.status in out  # the wall time: console only
    assert f"plan written to {tmp_path / 'p.json'}" in out


@pytest.mark.slow
def test_inspect_explain_diff_of_two_clusters(capsys, gpt_plans):
    a, b = gpt_plans["h100-sxm:1x8"], gpt_plans["h100-sxm:2x8"]
    assert re.search(r"blocks\.0(-\d+)?\.attn", _ok(capsys, "inspect", str(a)))  # identical blocks fold

    out = _ok(capsys, "explain", str(a), "--layer", "blocks.0.attn", "--top", "2")
    chosen = Plan.load(a).strategy("blocks.0.attn")
    assert f"{chosen.notation or 'DDP'} on stage {chosen.stage}" in out
    assert "best alternatives" in out and "why it lost" in out

    out = _ok(capsys, "diff", str(a), str(b))
    plan_a, plan_b = Plan.load(a), Plan.load(b)
    changed = [axis for axis in MESH_AXES if getattr(plan_a.mesh, axis) != getattr(plan_b.mesh, axis)]
    assert changed  # world 8 → 16 changes at least one degree
    for axis in changed:
        assert f"{axis} {getattr(plan_a.mesh, axis)} → {getattr(plan_b.mesh, axis)}" in out
    assert "plans make the same decisions" in _ok(capsys, "diff", str(a), str(a))


@pytest.mark.slow
def test_plan_reuse_skips_the_search(capsys, gpt_plans, monkeypatch, tmp_path):
    def no_search(*args, **kwargs):
        raise AssertionError("--plan must not search")

    monkeypatch.setattr(search, "solve", no_search)
    path = gpt_plans["h100-sxm:1x8"]
    out = _ok(capsys, "plan", "--plan", str(path), "--cluster", "h100-sxm:1x8", "-o", str(tmp_path / "copy.json"))
    assert "search skipped" in out
    assert Plan.load(tmp_path / "copy.json") == Plan.load(path)
    _ok(capsys, "plan", "gpt:tiny", "--plan", str(path), "--cluster", "h100-sxm:1x8", *TINY)  # same flags agree

    line = _one_line_error(capsys, "plan", "--plan", str(path), "--cluster", "h100-sxm:2x8")
    assert str(path) in line and "cluster field 'nodes': plan has 1, cluster has 2" in line
    line = _one_line_error(capsys, "plan", "--plan", str(path), "--cluster", "h100-sxm:1x8", "--batch", "32")
    assert "global_batch=16 (--batch)" in line and "32" in line
    line = _one_line_error(capsys, "plan", "llama:tiny", "--plan", str(path), "--cluster", "h100-sxm:1x8")
    assert "does not match model 'llama:tiny'" in line


@pytest.mark.slow
def test_retarget_solves_from_the_old_plan_and_prints_the_diff(capsys, gpt_plans, monkeypatch, tmp_path):
    hints = []
    real_solve = search.solve

    def spy(*args, hint=None, **kwargs):
        hints.append(hint)
        return real_solve(*args, hint=hint, **kwargs)

    monkeypatch.setattr(search, "solve", spy)
    old_path = gpt_plans["h100-sxm:1x8"]
    out = _ok(capsys, "plan", "--retarget", str(old_path), "--cluster", "h100-sxm:2x8", "-o", str(tmp_path / "new.json"))
    assert hints == [Plan.load(old_path)]
    new = Plan.load(tmp_path / "new.json")
    assert new.mesh.world_size == 16 and (new.global_batch, new.seq_len) == (16, 128)  # the old plan's step
    assert f"changes from {old_path}" in out and "predictions" in out


@pytest.mark.slow
def test_pins_mesh_and_memory_reach_the_plan(capsys, tmp_path):
    path = tmp_path / "pinned.json"
    _ok(capsys, "plan", "llama:tiny", "--cluster", "h100-sxm:1x8", *TINY, "--mesh", "tp=2,pp=1",
        "--pin", "blocks.*.attn:state=zero3,recompute=full", "--pin", "mlp:*:recompute=full",
        "--max-memory", "60GiB", "-o", str(path))
    plan = Plan.load(path)
    assert (plan.mesh.tp, plan.mesh.pp) == (2, 1)
    attn = [s for s in plan.layers if s.layer.endswith(".attn")]
    assert len(attn) == 2 and all((s.state, s.recompute) == ("zero3", "full") for s in attn)
    mlp = [s for s in plan.layers if s.layer.endswith(".mlp")]
    assert len(mlp) == 2 and all(s.recompute == "full" for s in mlp)  # pinned by class id glob


@pytest.mark.slow
def test_moe_with_fixed_expert_parallelism(capsys, tmp_path):
    path = tmp_path / "moe.json"
    _ok(capsys, "plan", "moe:tiny", "--cluster", "h100-sxm:1x8", *TINY, "--mesh", "ep=2", "-o", str(path))
    plan = Plan.load(path)
    assert plan.mesh.ep == 2
    moe_layers = [s for s in plan.layers if s.layer.endswith(".moe")]
    assert moe_layers and all(s.ep for s in moe_layers)


@pytest.mark.slow
def test_llama_7b_on_one_h100_node(capsys, tmp_path):
    path = tmp_path / "7b.json"
    out = _ok(capsys, "plan", "llama:7b", "--cluster", "h100-sxm:1x8", "--batch", "64", "--seq", "4096",
              "-o", str(path))
    plan = Plan.load(path)
    assert plan.mesh.world_size == 8 and len(plan.layers) == 4 + 4 * 32
    assert 0 < plan.predictions.peak_memory_bytes < 80 * 2**30
    assert "blocks.0-31" in out  # 32 identical blocks fold into one row
    out = _ok(capsys, "explain", str(path), "--layer", "blocks.7.mlp")
    assert "32 layer(s) share this choice" in out
    # a cluster too small: one device capped at 24 GiB cannot hold 7B's weights and gradients
    line = _one_line_error(capsys, "plan", "llama:7b", "--cluster", "h100-sxm:1x1", "--batch", "8", "--seq", "4096",
                           "--max-memory", "24GiB")
    assert "no plan fits in memory" in line and "(24.00 GiB less allocator headroom)" in line and "relax" in line


def test_progress_is_drawn_on_a_terminal_only():
    from rich.console import Console

    from autoshard.cli_search import Stages

    for terminal in (True, False):
        file = io.StringIO()
        with Stages(Console(file=file, force_terminal=terminal, width=100)) as stages:
            with stages.stage("capture", "capture gpt:tiny"):
                pass
            stages.done()
        assert set(stages.seconds) == {"capture"}
        assert ("capture gpt:tiny" in file.getvalue() and "done in" in file.getvalue()) == terminal
        assert (file.getvalue() == "") == (not terminal)


# -------------------------------------------------------------- bad inputs
PLAN = ("plan", "gpt:tiny", "--cluster", "h100-sxm:1x8")


@pytest.mark.parametrize(
    "argv, needles",
    [
        ((*PLAN, *TINY, "--pin", "blocks.*.attn:color=red"), ["--pin", "unknown field 'color'", "state, tp, sp"]),
        ((*PLAN, *TINY, "--pin", "blocks.*.attn:state=zero4"), ["state='zero4' is not allowed", "zero3"]),
        ((*PLAN, *TINY, "--pin", "blocks.*.attn:sp=maybe"), ["sp='maybe' is not a boolean", "true, false"]),
        ((*PLAN, *TINY, "--pin", "state=zero3"), ["TARGET:field=value"]),
        ((*PLAN, *TINY, "--pin", "nope.*:state=zero3"), ["'nope.*' matches no layer", "blocks.0.attn"]),
        ((*PLAN, *TINY, "--pin", "blocks.0.attn:state=zero3", "--pin", "blocks.*.attn:state=zero1"),
         ["state='zero1' on layer 'blocks.0.attn'", "set state='zero3'", "make the pins agree"]),
        ((*PLAN, *TINY, "--pin", "blocks.*.attn:state=zero1,weight_comm=int8"), ["weight_comm='int8' needs state='zero3'"]),
        ((*PLAN, *TINY, "--mesh", "foo=2"), ["--mesh", "unknown axis 'foo'", "dp_shard"]),
        ((*PLAN, *TINY, "--mesh", "tp=0"), ["tp='0' must be a positive integer"]),
        ((*PLAN, *TINY, "--mesh", "tp=3"), ["tp=3 does not divide", "[1, 2, 4, 8]"]),
        ((*PLAN, *TINY, "--mesh", "tp=4,pp=4"), ["tp=4*pp=4 = 16 does not divide the world size 8"]),
        ((*PLAN, *TINY, "--mesh", "cp=2"), ["cp=2", "allowed: cp=1"]),
        ((*PLAN, *TINY, "--max-memory", "60XB"), ["--max-memory", "'60XB'", "GiB"]),
        ((*PLAN, *TINY, "--max-memory", "0GiB"), ["more than 0 bytes"]),
        ((*PLAN, "--batch", "0", "--seq", "128"), ["--batch", "0 must be a positive integer"]),
        ((*PLAN, "--batch", "-4", "--seq", "128"), ["--batch", "-4 must be a positive integer"]),
        ((*PLAN, "--seq", "128"), ["missing --batch"]),
        ((*PLAN, *TINY, "--micro-batch", "3"), ["--micro-batch 3 does not divide --batch 16"]),
        ((*PLAN, "--batch", "12", "--seq", "128", "--mesh", "dp_shard=8"), ["batch_divides/dp", "global_batch"]),
        ((*PLAN, "--batch", "16", "--seq", "4096"), ["--seq 4096 exceeds gpt:tiny's max_seq_len=128"]),
        ((*PLAN, *TINY, "--optimizer", "adam"), ["invalid choice: 'adam'", "adamw"]),
        ((*PLAN, *TINY, "--time-limit", "0"), ["--time-limit", "positive"]),
        (("plan", "gpt:tiny", "--cluster", "nope-gpu:1x8", *TINY), ["nope-gpu"]),
        (("plan", "gpt:huge", "--cluster", "h100-sxm:1x8", *TINY), ["unknown size 'huge'", "tiny"]),
        (("plan", "--cluster", "h100-sxm:1x8", *TINY), ["no MODEL given"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else None,
)
@pytest.mark.slow
def test_bad_plan_input_is_one_line(capsys, argv, needles):
    line = _one_line_error(capsys, *argv)
    for needle in needles:
        assert needle in line, (needle, line)


@pytest.mark.slow
def test_plan_flags_that_cannot_apply_to_a_reused_plan(capsys, gpt_plans):
    line = _one_line_error(capsys, "plan", "--plan", str(gpt_plans["h100-sxm:1x8"]), "--cluster", "h100-sxm:1x8",
                           "--pin", "blocks.*.attn:state=zero3", "--mesh", "tp=2")
    assert "skips the search" in line and "--pin, --mesh" in line


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_bad_explain_and_diff_input_is_one_line(capsys, gpt_plans, tmp_path):
    path = gpt_plans["h100-sxm:1x8"]
    line = _one_line_error(capsys, "explain", str(path), "--layer", "blocks.9.attn")
    assert "'blocks.9.attn' is not in" in line and "blocks.0.attn" in line and "inspect --no-fold" in line

    bare = json.loads(path.read_text())
    bare["fingerprints"]["cluster_spec"] = {}
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    line = _one_line_error(capsys, "explain", str(tmp_path / "bare.json"), "--layer", "head")
    assert "records no cluster" in line and "--cluster" in line
    out = _ok(capsys, "explain", str(tmp_path / "bare.json"), "--layer", "head", "--cluster", "h100-sxm:1x8")
    assert "head" in out

    bare["model_name"] = "MyPolicy"
    (tmp_path / "custom.json").write_text(json.dumps(bare))
    line = _one_line_error(capsys, "explain", str(tmp_path / "custom.json"), "--layer", "head", "--cluster", "h100-sxm:1x8")
    assert "'MyPolicy'" in line and "autoshard.compile" in line

    line = _one_line_error(capsys, "diff", str(path), str(tmp_path / "missing.json"))
    assert "missing.json" in line
