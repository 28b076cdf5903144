"""``autoshard`` command line: models, clusters, plans, training.

Commands are rows of one table, ``COMMANDS``: a path (``("cluster", "show")``),
a one-line help, a function adding its arguments and a small handler
``(args, console) -> exit code``. ``build_parser`` registers every row (and the
group parsers its path needs, whose help is in ``GROUPS``); nothing else adds
subcommands, so ``tests/test_cli.py`` can check that every command has help
and that ``--help`` works for each. A command is registered only once its
stage works. The search commands (``plan``,
``explain``, ``diff``) keep their bodies in ``autoshard/cli_search.py``; their
flag grammar (``--pin``, ``--mesh``, ``--max-memory``) is documented there;
``ppo`` and ``plot`` live in ``autoshard/cli_ppo.py``, ``run`` in
``runtime/launch.py``, ``export`` in ``runtime/hf_export.py``, ``cluster
calibrate`` in ``autoshard/calibrate.py`` and ``report`` in ``autoshard/report.py``.

Errors: an ``AutoshardError`` (or ``OSError``) raised by a handler, and every
argument error, prints one line ``autoshard: error: <message>`` on stderr and
exits 2. ``--debug`` (before or after the command) prints the traceback
first. Any other exception is a bug and propagates with its traceback.

The modules behind the commands (models, capture, cluster) are imported
inside the handlers, so ``autoshard --help`` stays fast and one missing stage
does not break the others. ``main`` parses with ``build_parser(lazy=True)``:
a command's arguments (whose functions may import torch for a choices list)
are added only when that command is parsed or its help is shown, so
``autoshard --help`` and ``autoshard inspect`` never import torch
(``tests/test_cli_output.py``; ``benchmarks/startup_bench.py`` times them).
``python -m autoshard`` is the same entry (``autoshard/__main__.py``).

Output flags:

- ``-q/--quiet`` (before or after the command, as ``--debug``): no progress
  display (``autoshard/progress.py``) and, for ``ppo``, no per-step line;
  results and errors are still printed.
- ``--json`` (after ``models``, ``cluster show``, ``cluster detect``, ``inspect``,
  ``plan``): one JSON document on stdout instead of the tables: the model
  list, the cluster's ``Cluster.to_dict``, the plan's file form
  (``Plan.to_json``). Progress, if any, stays on stderr.

Progress: long work reports through ``autoshard/progress.py``: a live
display on a terminal; in a pipe, plain lines for the jobs (``ppo``,
``cluster calibrate``) and nothing for the commands whose output is a result
(``plan``, ``explain``, ``report``, ``capture``), which keep a pipe to that
result or one error line. Other libraries' deprecation warnings and torch's internal
``UserWarning`` are hidden while a command runs
(``autoshard/quiet_warnings.py``, also in the ranks ``run`` and ``ppo``
start); ``--debug`` shows them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from autoshard.cli_args import positive_int as _positive_int
from autoshard.cli_args import print_json
from autoshard.errors import AutoshardError
from autoshard.quiet_warnings import filter_third_party_warnings

PROG = "autoshard"
EXIT_OK = 0
EXIT_USER_ERROR = 2

Handler = Callable[[argparse.Namespace, Any], int | None]


class _UsageError(Exception):
    """An argument error; ``main`` prints it as one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors raise instead of printing usage and exiting.

    ``arguments``: a function adding this parser's arguments, called on the first
    parse or help of this parser (``build_parser(lazy=True)``), so building the
    tree imports nothing a command's arguments need."""

    def __init__(self, *args: Any, arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending_arguments = arguments

    def add_pending_arguments(self) -> None:
        """Add the deferred arguments now (once)."""
        pending, self._pending_arguments = self._pending_arguments, None
        if pending is not None:
            pending(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self.add_pending_arguments()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.add_pending_arguments()
        return super().format_help()

    def format_usage(self) -> str:
        self.add_pending_arguments()
        return super().format_usage()

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """A command without arguments."""


@dataclass(frozen=True)
class Command:
    """One subcommand: where it lives, what it says, what it parses and runs."""

    path: tuple[str, ...]
    help: str
    handler: Handler
    arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments


# ----------------------------------------------------------------- handlers
def _format_count(n: int) -> str:
    """``124_439_808`` → ``124.4M``; ``7_000_000_000`` → ``7.0B``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _args_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of the table")


def _cmd_models(args: argparse.Namespace, console: Any) -> int:
    from rich.table import Table
    from rich.text import Text

    from autoshard.models import list_models

    if args.json:
        print_json([{"model": e.spec, "family": e.family, "size": e.size, "params": e.params,
                     "description": e.description} for e in list_models()])
        return EXIT_OK
    table = Table(title="reference policy models", show_edge=False, header_style="bold")
    for name in ("model", "params", "description"):
        table.add_column(name, no_wrap=name != "description", justify="right" if name == "params" else "left")
    for entry in list_models():
        table.add_row(Text(f"{entry.family}:{entry.size}"), _format_count(entry.params), Text(entry.description))
    console.print(table)
    return EXIT_OK


def _args_capture(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="reference model 'family:size' (e.g. 'llama:tiny', see 'autoshard models'), or your own: 'package.module:factory' or 'path/to/file.py:factory' returning an nn.Module")
    parser.add_argument("--seq", type=_capture_seq, default=None, metavar="N", help="sequence length S: capture measures at S/2 and S, and the table reports per token at S")
    parser.add_argument("--batch", type=_positive_int, default=None, metavar="B", help="batch size of the example tokens (2 or more keeps the batch dim dynamic)")


def _cmd_capture(args: argparse.Namespace, console: Any) -> int:
    from autoshard.cli_search import capture_spec
    from autoshard.passes.capture import format_coverage, format_layer_table

    options: dict[str, Any] = {}
    if args.seq is not None:  # the two-point fit measures at S/2 and S, as capture does for example tokens
        options["seq_lens"] = (args.seq // 2, args.seq)
    if args.batch is not None:
        options["batch"] = args.batch
    with _progress(args) as progress:
        graph = capture_spec(args.model, progress=progress, **options)
    _print_text(console, format_layer_table(graph, seq_len=args.seq))
    _print_text(console, format_coverage(graph))
    return EXIT_OK


def _args_cluster_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="PRESET|FILE", help="a preset such as 'h100-sxm:2x8', a YAML/JSON cluster file, "
                        "or a calibration file written by 'autoshard cluster calibrate'")
    _args_json(parser)


def _cmd_cluster_show(args: argparse.Namespace, console: Any) -> int:
    from autoshard.cli_search import describe_cluster_spec

    if args.json:  # the cluster's from_dict schema (a calibration file is refused: it is not a cluster)
        from autoshard.cluster import Cluster

        print_json(Cluster.load(args.spec).to_dict())
        return EXIT_OK
    _print_text(console, describe_cluster_spec(args.spec))
    return EXIT_OK


def _cmd_cluster_detect(args: argparse.Namespace, console: Any) -> int:
    from autoshard.cluster import Cluster

    cluster = Cluster.detect()
    if args.json:
        print_json(cluster.to_dict())
        return EXIT_OK
    _print_text(console, cluster.describe())
    return EXIT_OK


def _notation_epilog(parser: argparse.ArgumentParser) -> None:
    """The strategy notation's legend (``Z2·qG4``, ``R(sel)``) below the flags of ``--help``."""
    from autoshard.plan_format import NOTATION_LEGEND

    parser.epilog = NOTATION_LEGEND
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _args_inspect(parser: argparse.ArgumentParser) -> None:
    _notation_epilog(parser)
    parser.add_argument("plan", metavar="PLAN.json", help="a plan file written by 'autoshard plan' or Plan.save")
    parser.add_argument("--no-fold", action="store_true", help="one row per layer (do not fold identical blocks)")
    _args_json(parser)


def _cmd_inspect(args: argparse.Namespace, console: Any) -> int:
    from autoshard.plan import Plan

    plan = Plan.load(args.plan)
    if args.json:  # the plan validated and in the current file form
        print_json(plan.to_json())
        return EXIT_OK
    console.print(plan.to_rich(fold=not args.no_fold))
    return EXIT_OK


def _args_plan(parser: argparse.ArgumentParser) -> None:
    from autoshard import cli_search
    from autoshard.train import COMM_PRECISIONS, OPTIMIZERS, PRECISIONS

    _notation_epilog(parser)
    parser.add_argument("model", nargs="?", metavar="MODEL", help="reference model (e.g. 'llama:7b') or 'package.module:factory' / 'file.py:factory' (default with --plan/--retarget: the plan's model)")
    parser.add_argument("--cluster", required=True, metavar="PRESET:NODESxDEVICES|FILE", help="the cluster to plan for, e.g. 'h100-sxm:2x8', or a YAML/JSON cluster file")
    parser.add_argument("--batch", type=_positive_int, metavar="B", help="global batch: sequences per optimizer step over all ranks (default with --plan/--retarget: the plan's)")
    parser.add_argument("--seq", type=_positive_int, metavar="S", help="tokens per sequence (default with --plan/--retarget: the plan's)")
    parser.add_argument("--micro-batch", type=_positive_int, metavar="N", help="sequences per forward/backward on one rank (default: the search chooses)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="optimizer whose states are sharded (default: adamw, or the plan's)")
    parser.add_argument("--precision", choices=PRECISIONS, help="compute and communication dtype (default: bf16, or the plan's)")
    parser.add_argument("--comm-precision", choices=COMM_PRECISIONS, dest="comm_precision",
                        help="'exact' (default): collectives move --precision values, as a hand-written baseline; "
                             "'auto': the search may choose lossy quantized wires (int8/int4/fp8) where faster")
    parser.add_argument("--time-limit", type=_positive_float, metavar="SECONDS", help="wall-clock budget of the search; the best plan so far is returned when it runs out (default 60)")
    parser.add_argument("--pin", action="append", default=[], type=_flag(cli_search.parse_pin), metavar="LAYER_OR_CLASS:field=value,...", help="fix strategy fields of the layers whose name or class id matches the glob, e.g. 'blocks.*.attn:state=zero3,recompute=full' (repeatable)")
    parser.add_argument("--mesh", type=_flag(cli_search.parse_mesh), default={}, metavar="axis=degree,...", help="fix mesh degrees, e.g. 'tp=2,pp=1'; axes: dp_replicate dp_shard tp pp ep cp")
    parser.add_argument("--max-memory", type=_flag(cli_search.parse_memory), metavar="BYTES", help="per-rank memory limit with a unit, e.g. 60GiB (default: the device memory)")
    parser.add_argument("--calibration", type=Path, metavar="CAL.json", help="apply this file of 'autoshard cluster calibrate' to --cluster before the search")
    parser.add_argument("-o", "--output", type=_output_path, metavar="PLAN.json", help="write the plan to this file (checked before the search: a regular file or a new one in a writable directory)")
    parser.add_argument("--json", action="store_true", help="print the plan's JSON (the file form) on stdout instead of the table")
    reuse = parser.add_mutually_exclusive_group()
    reuse.add_argument("--plan", type=Path, metavar="EXISTING.json", help="reuse this plan: check its fingerprints against the model and cluster, skip the search")
    reuse.add_argument("--retarget", type=Path, metavar="OLD.json", help="re-solve for --cluster starting from this plan as a hint, then print what changed")


def _cmd_plan(args: argparse.Namespace, console: Any) -> int:
    from autoshard.cli_search import PlanRequest, run_plan

    request = PlanRequest(
        model=args.model, cluster=args.cluster, batch=args.batch, seq=args.seq, micro_batch=args.micro_batch,
        optimizer=args.optimizer, precision=args.precision, comm_precision=args.comm_precision,
        time_limit_s=args.time_limit, pins=tuple(args.pin),
        mesh=args.mesh, max_memory_bytes=args.max_memory, output=args.output, reuse=args.plan,
        retarget=args.retarget, calibration=args.calibration, json=args.json,
    )
    run_plan(request, console, None if args.quiet else _make_console(stderr=True))
    return EXIT_OK


def _args_explain(parser: argparse.ArgumentParser) -> None:
    from autoshard import cli_search

    _notation_epilog(parser)
    parser.add_argument("plan", type=Path, metavar="PLAN.json", help="a plan file written by 'autoshard plan'")
    parser.add_argument("--layer", required=True, metavar="NAME", help="the layer to explain, e.g. 'blocks.0.attn' (see 'autoshard inspect --no-fold')")
    parser.add_argument("--top", type=_positive_int, default=5, metavar="K", help="how many of the best alternatives to show (default 5)")
    parser.add_argument("--cluster", metavar="PRESET:NODESxDEVICES|FILE", help="cluster to cost on (default: the one recorded in the plan)")
    parser.add_argument("--max-memory", type=_flag(cli_search.parse_memory), metavar="BYTES", help="per-rank memory limit the plan was searched under, e.g. 60GiB (default: the device memory)")
    parser.add_argument("--calibration", type=Path, metavar="CAL.json", help="price on the cluster with this file of 'autoshard cluster calibrate' applied (the one the plan was searched with)")


def _cmd_explain(args: argparse.Namespace, console: Any) -> int:
    from autoshard.cli_search import run_explain

    progress_console = None if args.quiet else _make_console(stderr=True)
    run_explain(args.plan, args.layer, args.top, args.cluster, args.max_memory, console, progress_console,
                calibration=args.calibration)
    return EXIT_OK


def _args_diff(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=Path, metavar="A.json", help="the plan to compare from")
    parser.add_argument("b", type=Path, metavar="B.json", help="the plan to compare to")


def _cmd_diff(args: argparse.Namespace, console: Any) -> int:
    from autoshard.cli_search import run_diff

    run_diff(args.a, args.b, console)
    return EXIT_OK


def _args_report(parser: argparse.ArgumentParser) -> None:
    from autoshard.report import add_report_arguments

    add_report_arguments(parser)


def _cmd_report(args: argparse.Namespace, console: Any) -> int:
    from autoshard.report import report_main

    return report_main(args, console, None if args.quiet else _make_console(stderr=True))


def _args_check(parser: argparse.ArgumentParser) -> None:
    from autoshard.check import add_check_arguments

    add_check_arguments(parser)


def _cmd_check(args: argparse.Namespace, console: Any) -> int:
    from autoshard.check import cmd_check

    return cmd_check(args, console)


def _args_ppo(parser: argparse.ArgumentParser) -> None:
    from autoshard.cli_ppo import add_ppo_arguments

    add_ppo_arguments(parser)


def _cmd_ppo(args: argparse.Namespace, console: Any) -> int:
    from autoshard.cli_ppo import cmd_ppo

    return cmd_ppo(args, console)


def _args_plot(parser: argparse.ArgumentParser) -> None:
    from autoshard.cli_ppo import add_plot_command_arguments

    add_plot_command_arguments(parser)


def _cmd_plot(args: argparse.Namespace, console: Any) -> int:
    from autoshard.cli_ppo import cmd_plot

    return cmd_plot(args, console)


def _args_run(parser: argparse.ArgumentParser) -> None:
    from autoshard.runtime.launch import add_run_arguments

    add_run_arguments(parser)


def _cmd_run(args: argparse.Namespace, console: Any) -> int:
    from autoshard.runtime.launch import run_main

    return run_main(args)


def _args_calibrate(parser: argparse.ArgumentParser) -> None:
    from autoshard.calibrate import add_calibrate_arguments

    add_calibrate_arguments(parser)


def _cmd_calibrate(args: argparse.Namespace, console: Any) -> int:
    from autoshard.calibrate import calibrate_main

    return calibrate_main(args, console)


def _args_export(parser: argparse.ArgumentParser) -> None:
    from autoshard.runtime.hf_export import DEFAULT_MAX_SHARD_SIZE, DTYPE_ALIASES, DTYPES

    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="an autoshard checkpoint directory (saved under any plan and world size)")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="the Hugging Face directory to write (new or empty): config.json and safetensors")
    parser.add_argument("--config", metavar="HF_DIR_OR_JSON", help="the model's Hugging Face config: a model directory or config.json (default: the one the checkpoint records, or the plan's MODEL directory)")
    parser.add_argument("--dtype", choices=[*DTYPES, *DTYPE_ALIASES], help="dtype of the written tensors (default: the config's dtype, else float32: exact)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE", help=f"largest safetensors file before the weights are sharded with an index, e.g. 500MB, 2GiB (default {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--value-head", type=Path, metavar="FILE.safetensors", help="also write the value head (dropped by default: not part of a causal LM) to this file, outside DIR")


def _cmd_export(args: argparse.Namespace, console: Any) -> int:
    from autoshard.runtime.hf_export import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.output, config=args.config, dtype=args.dtype,
                               max_shard_size=args.max_shard_size, value_head=args.value_head)
    files = f"{len(result.files)} safetensors file{'s' if len(result.files) > 1 else ''}"
    dtype = str(result.dtype).removeprefix("torch.")
    _print_text(console, f"wrote {result.hf_class} (step {result.step}) to {result.directory}: {files}, "
                         f"{result.total_bytes / 1e6:.1f} MB in {dtype} ({result.dtype_reason}); "
                         f"config from {result.config_source}")
    if result.dropped:
        where = f"written to {result.value_head}" if result.value_head else "dropped (--value-head FILE keeps it)"
        _print_text(console, f"value head {', '.join(result.dropped)}: {where}")
    return EXIT_OK


def _progress(args: argparse.Namespace) -> Any:
    """The progress reporter of a result command: a live display on a terminal stderr, else nothing
    (``autoshard/progress.py``; ``--quiet``: nothing)."""
    from autoshard.progress import reporter

    return reporter(quiet=args.quiet, console=_make_console(stderr=True), lines=False)


def _print_text(console: Any, value: Any) -> None:
    """Print a string verbatim (no markup, no highlighting) or any rich renderable."""
    if isinstance(value, str):
        console.print(value, markup=False, highlight=False, soft_wrap=True)
    else:
        console.print(value)


def _output_path(text: str) -> Path:
    """An output file path; an empty one is refused here (``Path("")`` would be the directory ``.``)."""
    if not text:
        raise argparse.ArgumentTypeError("the path is empty; give a file path such as plan.json")
    return Path(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a positive number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive, finite number of seconds")
    return value


def _flag(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a parser raising ``AutoshardError``, keeping its message
    (argparse replaces a plain ``ValueError``'s message with its own)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except AutoshardError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = parse.__name__
    return convert


def _capture_seq(text: str) -> int:
    value = _positive_int(text)
    if value < 4:
        raise argparse.ArgumentTypeError(f"{value} is too short: capture measures at S/2 and S, both >= 2; give S >= 4")
    return value


# -------------------------------------------------------------------- table
GROUPS: dict[tuple[str, ...], str] = {
    ("cluster",): "describe a cluster preset or file, or detect this machine",
}

COMMANDS: tuple[Command, ...] = (
    Command(("models",), "list the reference policy models, their sizes and parameter counts", _cmd_models,
            _args_json),
    Command(
        ("capture",),
        "capture a reference model with torch.export; print its layers and op coverage",
        _cmd_capture,
        _args_capture,
    ),
    Command(("cluster", "show"), "describe a cluster preset or cluster file", _cmd_cluster_show, _args_cluster_show),
    Command(("cluster", "detect"), "detect this machine's devices and describe them as a cluster", _cmd_cluster_detect,
            _args_json),
    Command(
        ("cluster", "calibrate"),
        "measure matmul/HBM efficiency and collective alpha/beta on this machine; write a calibration file",
        _cmd_calibrate,
        _args_calibrate,
    ),
    Command(
        ("inspect",),
        "show a plan file: mesh, per-layer strategies, predicted memory per rank and step time",
        _cmd_inspect,
        _args_inspect,
    ),
    Command(
        ("plan",),
        "search the fastest sharding plan of a reference model for a cluster (or reuse / retarget a plan)",
        _cmd_plan,
        _args_plan,
    ),
    Command(
        ("explain",),
        "why a plan gave a layer its strategy: its cost terms and the best alternatives",
        _cmd_explain,
        _args_explain,
    ),
    Command(("diff",), "what changed between two plans: mesh, schedule, layers, predictions", _cmd_diff, _args_diff),
    Command(
        ("report",),
        "draw a plan as one HTML page: strategy per layer, memory and step timeline per rank (and a Chrome trace)",
        _cmd_report,
        _args_report,
    ),
    Command(
        ("check",),
        "build every rank role of a plan at its world size (fake process group, meta tensors); match collectives and memory",
        _cmd_check,
        _args_check,
    ),
    Command(
        ("ppo",),
        "train a policy with PPO under a searched (or given) plan; starts the ranks itself on one node",
        _cmd_ppo,
        _args_ppo,
    ),
    Command(("plot",), "plot the training curves of a PPO metrics file to a PNG", _cmd_plot, _args_plot),
    Command(
        ("export",),
        "write a checkpoint as a Hugging Face directory (config.json + safetensors) that from_pretrained loads",
        _cmd_export,
        _args_export,
    ),
    Command(
        ("run",),
        "launch a training script for a plan through torchrun (processes from the plan's mesh)",
        _cmd_run,
        _args_run,
    ),
)


# ------------------------------------------------------------------- parser
def _debug_flag(parser: argparse.ArgumentParser, default: Any) -> None:
    """``--debug`` and ``--quiet``, accepted before or after the command (``default``: the root's value)."""
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show the traceback of an error, and other libraries' warnings")
    parser.add_argument("-q", "--quiet", action="store_true", default=default,
                        help="no progress display or per-step lines; results and errors only")


def build_parser(*, lazy: bool = False) -> argparse.ArgumentParser:
    """The root parser with every row of ``COMMANDS`` registered.

    ``lazy``: add each command's arguments only when it is parsed or its help shown
    (``_Parser``; what ``main`` does); otherwise now, so every parser is complete.
    """
    root = _Parser(prog=PROG, description="autoshard: capture, search and inspect sharding plans for policy models.")
    _debug_flag(root, False)
    root.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    subparsers: dict[tuple[str, ...], Any] = {(): _subparsers(root, ())}
    for command in COMMANDS:
        parent = _group_for(subparsers, command.path[:-1])
        leaf = parent.add_parser(command.path[-1], help=command.help, description=command.help,
                                 arguments=command.arguments)
        _debug_flag(leaf, argparse.SUPPRESS)  # keeps the root's value unless given here
        leaf.set_defaults(handler=command.handler)
        if not lazy:
            leaf.add_pending_arguments()
    return root


def _version() -> str:
    try:
        return importlib.metadata.version("autoshard")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Any:
    dest = "_".join(("command", *path))
    return parser.add_subparsers(dest=dest, metavar="COMMAND", required=True, title="commands")


def _group_for(subparsers: dict[tuple[str, ...], Any], path: tuple[str, ...]) -> Any:
    """The subparsers action of group ``path``, creating the group parser on first use."""
    if path not in subparsers:
        parent = _group_for(subparsers, path[:-1])
        group_help = GROUPS[path]  # a KeyError here: a command's group is missing from GROUPS
        group = parent.add_parser(path[-1], help=group_help, description=group_help)
        _debug_flag(group, argparse.SUPPRESS)
        subparsers[path] = _subparsers(group, path)
    return subparsers[path]


# --------------------------------------------------------------------- main
def _make_console(*, stderr: bool = False) -> Any:
    from rich.console import Console

    console = Console(highlight=False, stderr=stderr)
    if not console.is_terminal:
        console.width = max(console.width, 160)  # pipes and files get whole table rows
    return console


def _one_line(message: str) -> str:
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser(lazy=True).parse_args(argv)
        debug = args.debug
        with warnings.catch_warnings():  # the filters last as long as the command (main runs in tests too)
            filter_third_party_warnings(debug)
            return args.handler(args, _make_console()) or EXIT_OK
    except SystemExit as done:  # --help / --version
        return done.code if isinstance(done.code, int) else EXIT_OK
    except KeyboardInterrupt:
        return 130
    except (_UsageError, AutoshardError, OSError) as err:
        if debug:
            traceback.print_exc(file=sys.stderr)
        print(f"{PROG}: error: {_one_line(str(err))}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
