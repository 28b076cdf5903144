"""The CLI's output switches and start-up: ``--json`` documents, ``--quiet``, ``python -m autoshard``,
no torch import for ``--help`` and ``inspect``, and other libraries' warnings hidden only while a
command runs (shown with ``--debug``)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from autoshard.cli import main
from autoshard.plan import LayerStrategy, Mesh, Plan, Predictions, Schedule


def _json(capsys, *argv: str):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    return json.loads(out)  # the whole of stdout is one document


def _plan_file(tmp_path):
    layers = (LayerStrategy("embed", state="zero3"), LayerStrategy("head", state="zero1"))
    plan = Plan("gpt:tiny", Mesh(dp_shard=2), layers, Schedule(micro_batch=2, num_micro_batches=1),
                Predictions(step_time_s=0.5, peak_memory_bytes=2**30, tokens_per_s=1000.0), global_batch=4, seq_len=64)
    return plan.save(tmp_path / "plan.json")


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return done.stdout.strip()


# -------------------------------------------------------------------- --json
def test_models_json(capsys):
    models = _json(capsys, "models", "--json")
    assert any((m["model"], m["family"], m["size"]) == ("llama:tiny", "llama", "tiny") for m in models)
    assert all(isinstance(m["params"], int) and m["params"] > 0 for m in models)


def test_cluster_json(capsys):
    from autoshard.cluster import Cluster

    shown = _json(capsys, "cluster", "show", "h100-sxm:2x8", "--json")
    assert Cluster.from_dict(shown) == Cluster.load("h100-sxm:2x8")
    assert _json(capsys, "cluster", "detect", "--json")["nodes"] == 1


def test_inspect_json_is_the_plan(capsys, tmp_path):
    path = _plan_file(tmp_path)
    assert Plan.from_dict(_json(capsys, "inspect", str(path), "--json")) == Plan.load(path)


def test_plan_json_is_the_saved_plan(capsys, tmp_path):
    out = tmp_path / "p.json"
    data = _json(capsys, "plan", "gpt:tiny", "--cluster", "cpu:1x2", "--batch", "8", "--seq", "64", "--json",
                 "-o", str(out))
    assert Plan.from_dict(data) == Plan.load(out)


# ------------------------------------------------------------------ --quiet
@pytest.mark.parametrize("argv", [("--quiet", "models", "--json"), ("models", "-q", "--json")])
def test_quiet_before_or_after_the_command(capsys, argv):
    assert isinstance(_json(capsys, *argv), list)


# ------------------------------------------------------------------ start-up
@pytest.mark.slow
def test_python_dash_m_autoshard_help():
    done = subprocess.run([sys.executable, "-m", "autoshard", "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: autoshard") and done.stderr == ""


@pytest.mark.slow
def test_importing_the_cli_does_not_import_torch():
    assert _python("import autoshard.cli, sys; print('torch' in sys.modules)") == "False"


@pytest.mark.slow
def test_help_and_inspect_do_not_import_torch(tmp_path):
    """``main`` adds a command's arguments only when that command runs (``build_parser(lazy=True)``)."""
    path = _plan_file(tmp_path)
    code = ("import contextlib, io, sys\nfrom autoshard.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    codes = [main(['--help']), main(['plan', '--help']), main(['inspect', {str(path)!r}])]\n"
            "print(codes, 'torch' in sys.modules)")
    assert _python(code) == "[0, 0, 0] False"


# ----------------------------------------------------------------- warnings
no_warning_options = pytest.mark.skipif(bool(sys.warnoptions), reason="-W options turn the filters off")


@no_warning_options
def test_third_party_warnings_hidden_while_a_command_runs(capsys, monkeypatch):
    import autoshard.models as models

    real = models.list_models

    def noisy_list_models():
        warnings.warn("a library's deprecation", FutureWarning)
        warnings.warn("autoshard's own warning", UserWarning)
        return real()

    monkeypatch.setattr(models, "list_models", noisy_list_models)
    for argv, expected in ((["models", "--json"], ["autoshard's own warning"]),
                           (["--debug", "models", "--json"], ["a library's deprecation", "autoshard's own warning"])):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            before = list(warnings.filters)
            assert main(argv) == 0
            assert warnings.filters == before  # the filters last as long as the command
        assert [str(w.message) for w in seen] == expected
        capsys.readouterr()


@no_warning_options
def test_ranks_filter_unless_debug(monkeypatch):
    from autoshard.runtime import launch_child

    for debug, hidden in (("0", True), ("1", False)):
        monkeypatch.setenv(launch_child.DEBUG_ENV, debug)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            launch_child._filter_warnings()
            warnings.warn("torch internals", FutureWarning)
        assert (not seen) == hidden
