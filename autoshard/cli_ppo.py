"""The training commands of the CLI: ``autoshard ppo`` and ``autoshard plot``.

``autoshard ppo MODEL --cluster PRESET:NODESxDEVICES [--calibration CAL.json] --task NAME --steps N
[--weights DIR] [--plan plan.json] [--metrics out.jsonl] [--checkpoint DIR] [--resume]
[--seed S] [--plot curves.png] [--prompts FILE.jsonl --reward MODULE:FUNCTION] [--algo ppo|grpo]`` does, in order:

(``--prompts``/``--reward`` and the algorithm and generation flags are declared once, for this command and its
workers, in ``runtime/rl_options.py``; ``docs/ppo.md`` "Your own prompts and rewards".)

0. the model: MODEL is the CLI's grammar (``autoshard/models/source.py``): a
   reference ``family:size`` (built with the task vocabulary),
   ``package.module:factory``, ``file.py:factory`` (an actor-critic) or a
   Hugging Face config directory / ``config.json`` (``--weights DIR``: start
   from that directory's safetensors); ``ppo_program.load_policy`` and its
   note "user models". It is built on meta here, so a bad MODEL or a
   vocabulary smaller than the task's is refused in one line before any
   search or launch.
   With ``--resume`` the checkpoint's sidecar is checked against the
   captured policy here too (``ppo_checkpoint.check_resumable``): a
   checkpoint of another model (both named, or the first parameter whose
   shape changed), a missing checkpoint or one already at ``--steps`` is
   refused in one line, exit 2, before any search or launch; so is a
   ``--checkpoint`` that is a file, and a ``--metrics`` or ``--plot`` path
   that could not be written (``file_io.check_output_path``). After the plan, a ``--batch`` its dp
   ranks and PPO mini-batches cannot split is refused the same way.
1. the plan: ``--plan`` loads one (checked against the model by the runtime);
   otherwise capture the policy (``ppo_program.load_policy`` on meta) and search it for the
   cluster with what the runtime implements fixed: ``ep = cp = 1`` and
   ``recompute = none`` and no sequence parallelism everywhere (pipeline
   plans train: ``runtime/ppo_program.py``, note "PPO on pipeline stages");
   on a ``cpu`` cluster also unquantized
   communication (``weight_comm = grad_comm = bf16``, i.e. the compute
   dtype: the quantized paths would run the Triton interpreter there, and
   4-bit gradients of a tiny model are a poor default). Precision
   ``--precision`` (default fp32); with ``--plan`` the plan's.
2. the ranks:
   - under an existing torchrun (``RANK`` and ``WORLD_SIZE`` set) this
     process joins the job and trains (every rank runs the command; the
     search is deterministic, so every rank gets the same plan);
   - otherwise, on one node, it writes the plan next to the metrics file (or
     the checkpoint, or a temporary directory) and starts the plan's world
     size of ranks through torchrun (``runtime/launch.py``) running
     ``python -m autoshard.runtime.ppo_program`` (it prints ``starting N ranks``;
     ``--debug`` adds torchrun's command line); an error raised on the
     ranks is printed once (``autoshard: error: rank R: ...``, ranks with
     the same message folded) and the exit code is 2 for a user error, 1
     otherwise; a stalled rank stops the job after ``AUTOSHARD_TIMEOUT_S``
     (launch.py's docstring);
   - several nodes: refused, with the ``autoshard run`` line to use instead.
3. rank 0 reports each step (``runtime/metrics.py``'s ``LiveSummary``:
   ``step i/N  elapsed  ETA  tok/s`` and the headline metrics; in a log about
   20 lines, the first step, every k-th and the last, a live row under them
   on a terminal; none with ``--quiet``), writes ``--metrics`` JSON lines and, at the end, the
   ``--plot`` PNG and its path. The search of step 1 shows a live row on a
   terminal's stderr.

``autoshard plot METRICS.jsonl -o curves.png`` draws the curves of a metrics
file (``runtime/plot.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from autoshard import file_io
from autoshard.cli_args import positive_int as _positive_int  # one parser for positive-int flags across the CLI
from autoshard.errors import AutoshardError
from autoshard.runtime.build_options import Compile

DEFAULT_STEPS = 150
SEARCH_TIME_LIMIT_S = 30.0


def add_ppo_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``autoshard ppo``."""
    parser.add_argument("model", metavar="MODEL", help="reference policy ('llama:tiny', built with the task's vocabulary), "
                        "package.module:factory, path/file.py:factory (an actor-critic: tokens -> (logits, values)) "
                        "or a Hugging Face config directory / config.json")
    parser.add_argument("--weights", type=Path, metavar="DIR", help="start a Hugging Face config MODEL from this "
                        "directory's safetensors (the value head, which they lack, is initialised)")
    parser.add_argument("--cluster", required=True, metavar="PRESET:NODESxDEVICES", help="where to train, e.g. 'cpu:1x2' (two gloo ranks on this machine)")
    parser.add_argument("--calibration", type=Path, metavar="CAL.json", help="apply this file of 'autoshard cluster calibrate' to --cluster before the search")
    parser.add_argument("--task", default="arithmetic", metavar="NAME", help="reward task: arithmetic, addition or sorting (default arithmetic, the reference run's)")
    parser.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS, metavar="N", help=f"PPO steps in total; a resumed run continues up to N (default {DEFAULT_STEPS})")
    parser.add_argument("--plan", type=Path, metavar="PLAN.json", help="train under this plan instead of searching one")
    parser.add_argument("--context", type=_positive_int, metavar="N", help="positions of a reference model (prompt + "
                        "response; default 32, what the built-in tasks need); other models keep their own")
    parser.add_argument("--rollout-tp", default="auto", type=_rollout_tp, metavar="auto|N",
                        help="ranks per generation group (a Megatron shard each): 'auto' (default) searches it with "
                             "the training plan, pricing the whole RL step; N fixes it")
    parser.add_argument("--metrics", type=Path, metavar="OUT.jsonl", help="JSON lines of per-step metrics (rank 0)")
    parser.add_argument("--checkpoint", type=Path, metavar="DIR", help="save the PPO state here at the end (and every --save-every steps)")
    parser.add_argument("--save-every", type=_positive_int, default=None, metavar="K", help="also checkpoint every K steps")
    parser.add_argument("--resume", action="store_true", help="resume from --checkpoint (saved under any plan or world size)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the model, prompts and sampling (default 0)")
    parser.add_argument("--batch", type=_positive_int, default=64, metavar="B", help="prompts per step over all data-parallel ranks (default 64)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="compute dtype of a searched plan (default fp32; masters are fp32 either way)")
    parser.add_argument("--plot", type=Path, metavar="CURVES.png", help="write the training curves here at the end (needs --metrics)")
    parser.add_argument("--profile", action="store_true", help="record one step (the second) with torch.profiler: "
                        "a Chrome trace per rank next to --metrics (METRICS.rankR.trace.json) for `autoshard report "
                        "PLAN --measured`")
    parser.add_argument("--no-rollout-cache", action="store_true", help="sample by recomputing prefixes through the sharded program instead of the KV-cached rollout replica (less memory, slower)")
    parser.add_argument("--compile", choices=[mode.value for mode in Compile], default=Compile.AUTO.value,
                        help="run the policy and reference programs through torch.compile on fixed padded shapes: "
                             "'auto' (default) where the runtime compiles (a GPU), 'off' eager; the search prices what runs")
    from autoshard.runtime.rl_options import add_rl_arguments

    add_rl_arguments(parser)  # --prompts, --reward, --algo, ... (shared with the workers)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer")
    return int(text)


def _rollout_tp(text: str) -> str | int:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1 or int(text) & (int(text) - 1):
        raise argparse.ArgumentTypeError(f"{text!r}: 'auto' or a power of two (1, 2, 4, 8)")
    return int(text)


def add_plot_command_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``autoshard plot`` (``runtime/plot.py``)."""
    from autoshard.runtime.plot import add_plot_arguments

    add_plot_arguments(parser)


def cmd_plot(args: argparse.Namespace, console: Any) -> int:
    """``autoshard plot METRICS.jsonl [-o OUT.png]``."""
    from autoshard.runtime.plot import plot_main

    return plot_main(args)


def cmd_ppo(args: argparse.Namespace, console: Any) -> int:
    """``autoshard ppo``: plan (search or load), then train here or through torchrun (module docstring)."""
    from autoshard.cli_search import load_cluster, reference_spec
    from autoshard.runtime import rl_data, rl_options
    from autoshard.runtime.ppo_program import capture_policy, check_policy_vocab, load_policy, policy_context

    _check_flags(args)
    data, options = rl_options.source_from_args(args), rl_options.options_from_args(args)
    if data is None:  # a built-in task: its name is refused before the policy is built
        from autoshard.runtime.tasks import TASK_PRESETS, get_task

        get_task(args.task, **TASK_PRESETS.get(args.task, {}))
    tokenizer = rl_data.run_tokenizer(data)
    policy = load_policy(reference_spec(args.model), args.seed, "meta", weights=_text(args.weights), context=args.context,
                         vocab_size=tokenizer.vocab_size)
    # TaskError naming the tasks, a bad prompt file or reward, before any search
    task, sampling = rl_data.build_task(args.task, data, options, context=policy_context(policy.module),
                                       tokenizer=tokenizer)
    check_policy_vocab(policy.module, policy.name, task)
    spec = policy.name  # file paths made absolute: the workers and plans name the model alike
    cluster = load_cluster(args.cluster, args.calibration)
    graph = capture_policy(policy.module, policy.name) if args.plan is None or args.resume else None
    if args.resume:
        _check_resume(args, graph)
    from autoshard.runtime.ppo_policy import rollout_cache_unsupported

    workload = None if rollout_cache_unsupported(policy.module) else rollout_workload(
        args.batch, task.prompt_len, sampling, compiled=args.compile != "off", algo=options.algo)
    plan = _resolve_plan(args, graph, cluster, console, workload)
    _check_batch(args, plan, task)
    if _under_torchrun():
        return _train_here(args, spec, plan)
    if cluster.nodes > 1:
        raise AutoshardError(
            f"cluster {args.cluster!r} has {cluster.nodes} nodes; start every node with "
            "`autoshard run PLAN.json --nnodes N --rdzv-endpoint HOST:PORT -- -m autoshard.runtime.ppo_program "
            "--plan PLAN.json ...` (write the plan with `autoshard plan` first)"
        )
    plan_path = _plan_file(args, plan)
    return _launch(args, spec, plan_path, console)


def _check_flags(args: argparse.Namespace) -> None:
    if args.resume and args.checkpoint is None:
        raise AutoshardError("--resume needs --checkpoint DIR (the directory a previous run saved to)")
    if args.plot is not None and args.metrics is None:
        raise AutoshardError(f"--plot {str(args.plot)!r} plots the metrics file; also pass --metrics OUT.jsonl")
    if getattr(args, "profile", False) and args.metrics is None:
        raise AutoshardError("--profile writes its traces next to the metrics file; also pass --metrics OUT.jsonl")
    if args.save_every is not None and args.checkpoint is None:
        raise AutoshardError("--save-every needs --checkpoint DIR to save to")
    if args.checkpoint is not None and args.checkpoint.exists() and not args.checkpoint.is_dir():
        raise AutoshardError(f"--checkpoint {str(args.checkpoint)!r} is a file, not a directory; give a new "
                             "directory, or the one a previous run saved to")
    # rank 0 writes them at the end: refused now, not after training (parents are created, as the writers do)
    if args.metrics is not None:
        file_io.check_output_path(args.metrics, noun="--metrics file", parents=True)
    if args.plot is not None:
        file_io.check_output_path(args.plot, noun="--plot file", parents=True)


def _check_batch(args: argparse.Namespace, plan: Any, task: Any) -> None:
    """Refuse a ``--batch`` the plan's dp ranks cannot split (ranks would raise it, one per rank, after starting)."""
    import math

    from autoshard.runtime.ppo_program import PPORun, ppo_config
    from autoshard.runtime.rl_options import options_from_args

    run = PPORun(global_batch=args.batch, seed=args.seed, rl=options_from_args(args))
    try:
        ppo_config(run, plan.mesh.dp, task.max_response_len)
    except AutoshardError as err:
        multiple = plan.mesh.dp * math.lcm(run.mini_batches, max(run.rl.group(), 1))
        raise AutoshardError(f"--batch {args.batch} cannot be split over the plan's dp={plan.mesh.dp} ranks and "
                             f"{run.mini_batches} mini-batches ({err}); use a multiple of {multiple}") from None


def _check_resume(args: argparse.Namespace, graph: Any) -> None:
    """Refuse a ``--checkpoint`` of another model, or one with no step left to train (module docstring, step 0)."""
    from autoshard.runtime.ppo_checkpoint import check_resumable

    info = check_resumable(args.checkpoint, graph)
    if info.step >= args.steps:
        raise AutoshardError(
            f"checkpoint {str(args.checkpoint)!r} is at step {info.step}, and --steps {args.steps} counts the steps "
            f"of the whole run: nothing is left to train; pass --steps above {info.step} to continue it"
        )


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rollout_workload(batch: int, prompt_len: int, sampling: Any, mini_batches: int = 2, compiled: bool = True,
                     algo: str = "ppo") -> Any:
    """What one RL step samples, for pricing the rollout layout (``search/rollout.py``); ``compiled``: PPO's
    programs compile where the runtime compiles (``--compile`` other than off); ``algo``: GRPO has no GAE loop."""
    from autoshard.search.rollout import RolloutWorkload

    return RolloutWorkload(sequences=batch, prompt_len=max(1, prompt_len), response_len=sampling.max_new_tokens,
                           mini_batches=mini_batches, compiled=compiled, gae=algo == "ppo")


def _resolve_plan(args: argparse.Namespace, graph: Any, cluster: Any, console: Any, workload: Any = None) -> Any:
    """The plan of ``--plan``, or one searched for ``cluster`` (against the policy's ``graph``) with the runtime's
    limits pinned, its rollout layout chosen with it (``--rollout-tp``)."""
    from autoshard.plan import Plan

    if args.plan is not None:
        return Plan.load(args.plan)
    from autoshard.progress import reporter

    first = os.environ.get("RANK", "0") == "0"  # under torchrun every rank searches; one shows it
    with reporter(sys.stderr, quiet=_quiet(args) or not first, lines=False) as progress:  # live on a terminal
        plan = search_plan(graph, cluster, args.batch, args.precision, progress=progress, workload=workload,
                           rollout_tp=args.rollout_tp, rollout_cache=not args.no_rollout_cache,
                           compiled=args.compile != "off")
    if first:
        console.print(plan.to_rich())
    return plan


def search_plan(graph: Any, cluster: Any, batch: int, precision: str = "fp32", progress: Any = None,
                workload: Any = None, rollout_tp: str | int = "auto", rollout_cache: bool = True,
                compiled: bool = True) -> Any:
    """The plan ``autoshard ppo`` searches for the PPO policy ``graph`` on ``cluster`` (module docstring, step 1:
    what the runtime implements fixed), for ``batch`` prompts per step in ``precision``.

    With a ``workload`` (``rollout_workload``) and the KV-cached rollout on, the training plan and the rollout
    layout are chosen together (``search/rollout.co_plan``: one search per rollout tp, the RL step priced
    whole); ``rollout_tp`` N fixes the layout instead (priced, recorded). ``compiled``: the programs run
    compiled where the runtime compiles them (``--compile``; ``runtime/ppo_program`` note "compiled PPO"),
    so priced compiled there (``layer_terms.runs_compiled``), else eager."""
    from autoshard.runtime.ppo_program import MODEL_MAX_SEQ_LEN
    from autoshard.search import solve
    from autoshard.search.space import Constraints
    from autoshard.train import TrainSpec

    pins = {layer.name: _runtime_pins(cluster) for layer in graph.layers}
    constraints = Constraints(pin=pins, mesh={"ep": 1, "cp": 1})
    train = TrainSpec(global_batch=batch, seq_len=MODEL_MAX_SEQ_LEN, precision=precision, compiled=compiled)
    if workload is None or not rollout_cache:
        return solve(graph, cluster, train, constraints=constraints, time_limit_s=SEARCH_TIME_LIMIT_S, progress=progress)
    import functools

    from autoshard.search import rollout

    # an RL optimizer step: one mini-batch of the sampled sequences, prompt + response long
    train = TrainSpec(global_batch=max(1, workload.sequences // workload.mini_batches), seq_len=workload.seq_len,
                      precision=precision, compiled=compiled)
    search = functools.partial(solve, time_limit_s=SEARCH_TIME_LIMIT_S, progress=progress)
    if rollout_tp != "auto":
        plan = rollout.solve_for_rollout(graph, cluster, train, int(rollout_tp), solve=search, constraints=constraints)
        return rollout.with_rollout(graph, cluster, plan, int(rollout_tp), workload)
    return rollout.co_plan(graph, cluster, train, workload, solve=search, constraints=constraints)


def _runtime_pins(cluster: Any) -> dict[str, Any]:
    # no sequence parallelism: PPO's sequences (prompt + sampled response − 1) have any length, SP needs tp | S
    pins: dict[str, Any] = {"recompute": "none", "ep": False, "sp": False}
    if cluster.device.name.lower().startswith("cpu"):
        pins.update(weight_comm="bf16", grad_comm="bf16")
    return pins


def _plan_file(args: argparse.Namespace, plan: Any) -> Path:
    """Where the workers read the plan: ``--plan`` itself, else a file next to the run's outputs."""
    if args.plan is not None:
        return args.plan.absolute()
    for anchor in (args.metrics, args.checkpoint):
        if anchor is not None:
            path = anchor.absolute().parent / f"{anchor.stem}.plan.json"
            break
    else:
        path = Path(tempfile.mkdtemp(prefix="autoshard-ppo-")) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return path


def _worker_flags(args: argparse.Namespace, spec: str, plan_path: Path) -> list[str]:
    flags = ["--plan", str(plan_path), "--model", spec, "--task", args.task, "--steps", str(args.steps),
             "--seed", str(args.seed), "--batch", str(args.batch)]
    if args.context is not None:
        flags += ["--context", str(args.context)]
    for flag, value in (("--metrics", args.metrics), ("--checkpoint", args.checkpoint), ("--plot", args.plot),
                        ("--weights", args.weights)):
        if value is not None:
            flags += [flag, str(Path(value).absolute())]
    if args.save_every is not None:
        flags += ["--save-every", str(args.save_every)]
    if args.resume:
        flags.append("--resume")
    if _quiet(args):
        flags.append("--no-live")
    if args.no_rollout_cache:
        flags.append("--no-rollout-cache")
    if getattr(args, "profile", False):
        flags.append("--profile")
    flags += ["--compile", getattr(args, "compile", "auto")]
    from autoshard.runtime.rl_options import rl_worker_flags

    return flags + rl_worker_flags(args, absolute=lambda value: str(Path(value).absolute()))


def _launch(args: argparse.Namespace, spec: str, plan_path: Path, console: Any) -> int:
    """Start the plan's ranks on this node through torchrun; returns torchrun's exit code."""
    from autoshard.runtime.launch import build_launch, launch

    command = ["-m", "autoshard.runtime.ppo_program", *_worker_flags(args, spec, plan_path)]
    launch_spec = build_launch(plan_path, command)
    # rank 0's live line must reach a pipe as it is printed, not when a block buffer fills
    launch_spec = dataclasses.replace(launch_spec, env={**launch_spec.env, "PYTHONUNBUFFERED": "1"})
    debug = getattr(args, "debug", False)
    command_line = f": {subprocess.list2cmdline(launch_spec.argv)}" if debug else ""  # torchrun's, for --debug
    console.print(f"starting {launch_spec.nproc_per_node} ranks{command_line}", markup=False, highlight=False,
                  soft_wrap=True)
    return launch(launch_spec, debug=debug)


def _train_here(args: argparse.Namespace, spec: str, plan: Any) -> int:
    """Join the surrounding torchrun job and train on this rank."""
    import torch.distributed as dist

    from autoshard.runtime import ppo_program as P
    from autoshard.runtime.rl_options import options_from_args, source_from_args

    run = P.PPORun(
        model=spec, weights=_text(args.weights), task=args.task, steps=args.steps, seed=args.seed,
        global_batch=args.batch, metrics=_text(args.metrics), checkpoint=_text(args.checkpoint), save_every=args.save_every or 0,
        resume=args.resume, plot=_text(args.plot), live=not _quiet(args), rollout_cache=not args.no_rollout_cache,
        profile=getattr(args, "profile", False), data=source_from_args(args), rl=options_from_args(args),
        compile=getattr(args, "compile", "auto"),
    )
    created = P.init_distributed(plan)
    try:
        P.run_ppo(run, plan, device=P.worker_device())
    finally:
        if created:
            dist.destroy_process_group()
    return 0


def _quiet(args: argparse.Namespace) -> bool:
    """``--quiet``: the CLI's common flag (``autoshard/cli.py``), absent under ``add_ppo_arguments`` alone."""
    return getattr(args, "quiet", False)


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


__all__ = ["add_plot_command_arguments", "add_ppo_arguments", "cmd_plot", "cmd_ppo", "search_plan"]
