"""The ``autoshard`` CLI, in process: every command documented, exit codes,
one-line user errors, ``--debug`` tracebacks, and each command for real."""

from __future__ import annotations

import argparse
import json

import pytest

from autoshard.cli import COMMANDS, GROUPS, build_parser, main
from autoshard.plan import LayerStrategy, Mesh, Plan, Predictions, Schedule


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, help, parser) of every registered subcommand, groups included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*path, name), helps.get(name), sub
                yield from _walk(sub, (*path, name))


def _is_group(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


COMMAND_PATHS = [path for path, _, _ in _walk(build_parser())]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoshard: error: "), err
    for needle in needles:
        assert needle in lines[0]


# --------------------------------------------------------------- documented
def test_every_registered_command_has_help_and_is_in_the_table():
    found = list(_walk(build_parser()))
    assert all(help_text and help_text.strip() for _, help_text, _ in found), [p for p, h, _ in found if not h]
    leaves = {path for path, _, sub in found if not _is_group(sub)}
    groups = {path for path, _, sub in found if _is_group(sub)}
    assert leaves == {command.path for command in COMMANDS}
    assert groups == set(GROUPS)


def test_every_argument_has_help():
    for path, _, sub in [((), "root", build_parser()), *_walk(build_parser())]:
        for action in sub._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"autoshard {' '.join(path)}: argument {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize("path", [(), *COMMAND_PATHS], ids=lambda p: " ".join(p) or "autoshard")
def test_help_works_for_each_command(capsys, path):
    code, out, err = _run(capsys, *path, "--help")
    assert code == 0 and err == ""
    assert out.startswith(f"usage: {' '.join(('autoshard', *path))}")


# ------------------------------------------------------------------ inspect
def _plan_file(tmp_path):
    layers = [LayerStrategy("embed", state="zero3")]
    layers += [LayerStrategy(f"blocks.{b}.{part}", state="zero3", tp="megatron", sp=True, recompute="selective")
               for b in range(4) for part in ("attn", "mlp")]
    layers.append(LayerStrategy("head", state="zero1"))
    plan = Plan(
        "gpt:tiny", Mesh(dp_shard=4, tp=2), tuple(layers), Schedule(micro_batch=2, num_micro_batches=4),
        Predictions(step_time_s=0.5, peak_memory_bytes=3 * 2**30, tokens_per_s=1000.0), global_batch=32, seq_len=256,
    )
    return plan.save(tmp_path / "plan.json")


def test_inspect_saved_plan(capsys, tmp_path):
    code, out, err = _run(capsys, "inspect", str(_plan_file(tmp_path)))
    assert code == 0 and err == ""
    assert "mesh dp_replicate=1 dp_shard=4 tp=2 pp=1 ep=1 cp=1 (world 8) | no pipeline: 4 micro-batches of 2 sequences accumulated per step" in out
    assert "predicted step 500 ms" in out and "peak 3.00 GiB" in out
    assert "blocks.0-3.attn" in out and "Z3·TP·SP·R(sel)" in out and "head" in out
    code, out, _ = _run(capsys, "inspect", "--no-fold", str(_plan_file(tmp_path)))
    assert code == 0 and "blocks.2.mlp" in out and "blocks.0-3.attn" not in out


def test_inspect_corrupt_plan_is_one_line(capsys, tmp_path):
    path = _plan_file(tmp_path)
    data = json.loads(path.read_text())
    data["layers"][3]["state"] = "zero4"
    path.write_text(json.dumps(data))
    _assert_one_line_error(*_run(capsys, "inspect", str(path)), str(path), "layers[3].state: 'zero4' not in")
    path.write_bytes(path.read_bytes()[:100])
    _assert_one_line_error(*_run(capsys, "inspect", str(path)), str(path), "truncated")
    _assert_one_line_error(*_run(capsys, "inspect", str(tmp_path / "missing.json")), "missing.json")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_traceback(capsys, tmp_path, where):
    path = tmp_path / "bad.json"
    path.write_text("{")
    argv = ["--debug", "inspect", str(path)] if where == "before" else ["inspect", str(path), "--debug"]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert "Traceback (most recent call last)" in err and "PlanError" in err
    assert err.rstrip().splitlines()[-1].startswith("autoshard: error: ")


def test_usage_errors_are_one_line(capsys):
    _assert_one_line_error(*_run(capsys, "frobnicate"), "invalid choice: 'frobnicate'", "autoshard --help")
    _assert_one_line_error(*_run(capsys, "inspect"), "PLAN.json", "autoshard inspect --help")
    _assert_one_line_error(*_run(capsys, "cluster"), "autoshard cluster --help")
    _assert_one_line_error(*_run(capsys, "capture", "x", "--seq", "0"), "--seq", "positive integer")
    _assert_one_line_error(*_run(capsys, "capture", "x", "--seq", "3"), "--seq", "S >= 4")
    _assert_one_line_error(*_run(capsys, "capture", "x", "--batch", "two"), "--batch", "'two' is not an integer")


# -------------------------------------------- commands backed by other stages
def test_models_lists_every_reference_model(capsys):
    from autoshard.models import list_models

    code, out, err = _run(capsys, "models")
    assert code == 0 and err == ""
    for entry in list_models():
        assert f"{entry.family}:{entry.size}" in out


def test_unknown_model_is_one_line(capsys):
    _assert_one_line_error(*_run(capsys, "capture", "no-such-model:huge"), "no-such-model")


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_capture_smallest_model(capsys):
    from autoshard.models import list_models

    smallest = min(list_models(), key=lambda entry: entry.params)
    code, out, err = _run(capsys, "capture", f"{smallest.family}:{smallest.size}", "--seq", "8", "--batch", "2")
    assert code == 0, err
    assert "embed" in out and "value_head" in out  # the layer table
    assert "aten.linear" in out  # the op coverage


def test_cluster_show_preset(capsys):
    code, out, err = _run(capsys, "cluster", "show", "h100-sxm:2x8")
    assert code == 0 and err == ""
    assert "H100" in out


def test_unknown_cluster_preset_is_one_line(capsys):
    _assert_one_line_error(*_run(capsys, "cluster", "show", "no-such-gpu"), "no-such-gpu")


def test_cluster_detect(capsys):
    code, out, err = _run(capsys, "cluster", "detect")
    assert code == 0 and err == "" and out.strip()
