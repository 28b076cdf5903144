"""``make demo``: plan a 7B policy for an H100 node, then train a tiny one with PPO on 2 CPU ranks.

The output is a short story, one heading per stage:

1. **capture**: a 7B Llama-style policy (``DEMO_POLICY``) captured with
   ``torch.export`` on the meta device (no weights allocated): one line, its
   layers and parameters.
2. **plan**: its CP-SAT search for the preset cluster ``h100-sxm:1x8``; the
   plan's table (the only table of the demo) and the search time.
3. **train**: ``autoshard ppo llama:tiny --cluster cpu:1x2 --plan PLAN``: the
   demo searches the policy's plan as ``autoshard ppo`` would
   (``cli_ppo.search_plan``) and shows it in one line, then ``autoshard ppo``
   starts two gloo ranks on this machine through torchrun and trains the
   reference run (``runtime/ppo_demo.py``: arithmetic sequences, reward from
   ≈ 0.07 to ≈ 0.75 in 150 steps). Rank 0 reports through the progress
   reporter (``runtime/metrics.py``'s ``LiveSummary``): in a pipe about 20
   plain step lines (the first, every k-th and the last), on a terminal the
   same lines above a live row.
4. **result**: the reward of the first and last step, the training time, and
   where the metrics, the plan and the training-curves PNG went.

The capture and the search show a live row on a terminal and nothing in a
pipe (``autoshard/progress.py``). If the sharded 2-rank run fails (exit code
≠ 0), the demo says so and falls back to the single-process reference run
(``run_demo``), which trains the same policy without the sharded runtime.

``python -m autoshard.demo --steps N --out DIR [--skip-plan]`` shortens it
(the smoke test uses a few steps; ``--skip-plan`` skips stages 1 and 2).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console

DEMO_CLUSTER = "h100-sxm:1x8"
DEMO_POLICY = "llama:7b"
DEMO_TRAIN = dict(global_batch=64, seq_len=4096)
PPO_MODEL = "llama:tiny"
PPO_CLUSTER = "cpu:1x2"
PPO_BATCH = 64
PPO_STEPS = 150


@dataclass(frozen=True)
class TrainResult:
    """What stage 3 leaves for stage 4: exit code (0, or 1 after the fallback), files, wall seconds."""

    code: int
    metrics: Path
    curves: Path
    plan: Path | None
    seconds: float


def _progress(console: Console) -> Any:
    """A live row on a terminal, nothing in a pipe (the demo's own lines tell the story there)."""
    from autoshard.progress import reporter

    return reporter(console=console, lines=False)


def capture_step(console: Console) -> Any:
    """Stage 1: capture ``DEMO_POLICY`` on meta; one line. Returns the ``ModelGraph``."""
    from autoshard.passes.capture import capture_reference

    console.rule(f"1. capture {DEMO_POLICY} (torch.export on the meta device)")
    start = time.perf_counter()
    with _progress(console) as progress:
        graph = capture_reference(DEMO_POLICY, progress=progress)
    console.print(f"{len(graph.layers)} layers, {graph.param_count / 1e9:.2f}B parameters, no weights allocated; "
                  f"{time.perf_counter() - start:.1f} s", markup=False, highlight=False)
    return graph


def plan_step(console: Console, graph: Any) -> None:
    """Stage 2: search the plan of ``graph`` for ``DEMO_CLUSTER``; print its table."""
    from autoshard.cluster import Cluster
    from autoshard.search import solve
    from autoshard.train import TrainSpec

    console.rule(f"2. plan {DEMO_POLICY} on {DEMO_CLUSTER}, batch {DEMO_TRAIN['global_batch']} × seq "
                 f"{DEMO_TRAIN['seq_len']}")
    with _progress(console) as progress:
        plan = solve(graph, Cluster.load(DEMO_CLUSTER), TrainSpec(**DEMO_TRAIN), progress=progress)
    console.print(plan.to_rich())
    console.print(f"search {plan.solver.wall_s:.1f} s ({plan.solver.status})", markup=False, highlight=False)


def plan_line(plan: Any) -> str:
    """One line for a plan: mesh, strategies with their layer counts, predicted step."""
    from autoshard.plan_format import format_seconds

    from autoshard.plan import MESH_AXES

    mesh = " ".join(f"{axis}={getattr(plan.mesh, axis)}" for axis in MESH_AXES if getattr(plan.mesh, axis) > 1)
    strategies = ", ".join(f"{name} ×{count}" for name, count in Counter(str(s) for s in plan.layers).most_common())
    return (f"plan: {plan.mesh.world_size} ranks ({mesh or 'one rank'}); layers {strategies}; predicted step "
            f"{format_seconds(plan.predictions.step_time_s)}")


def _ppo_plan(console: Console, out: Path) -> Path:
    """The plan ``autoshard ppo`` would search for ``PPO_MODEL`` on ``PPO_CLUSTER``, shown in one line and saved."""
    from autoshard.cli_ppo import search_plan
    from autoshard.cluster import Cluster
    from autoshard.runtime.ppo_program import capture_policy, load_policy

    policy = load_policy(PPO_MODEL, 0, "meta")
    with _progress(console) as progress:
        plan = search_plan(capture_policy(policy.module, policy.name), Cluster.load(PPO_CLUSTER), PPO_BATCH,
                           progress=progress)
    console.print(plan_line(plan), markup=False, highlight=False)
    return plan.save(out / "ppo.plan.json")


def ppo_step(console: Console, steps: int, out: Path) -> TrainResult:
    """Stage 3: ``autoshard ppo`` on 2 CPU ranks; falls back to single-process PPO if it fails."""
    from autoshard.cli import main as cli_main

    console.rule(f"3. train {PPO_MODEL} with PPO on {PPO_CLUSTER} (2 gloo ranks), {steps} steps")
    start = time.perf_counter()
    metrics, curves = out / "metrics.jsonl", out / "curves.png"
    metrics.unlink(missing_ok=True)  # the writer appends; a demo starts fresh
    plan = _ppo_plan(console, out)
    argv = ["ppo", PPO_MODEL, "--cluster", PPO_CLUSTER, "--plan", str(plan), "--steps", str(steps),
            "--batch", str(PPO_BATCH), "--metrics", str(metrics), "--plot", str(curves)]
    code = cli_main(argv)
    if code == 0:
        return TrainResult(0, metrics, curves, plan, time.perf_counter() - start)
    console.print(f"[bold red]the sharded 2-rank PPO run failed (exit code {code}); falling back to the "
                  "single-process reference run (runtime/ppo_demo.py), NOT the sharded runtime[/]", soft_wrap=True)
    start = time.perf_counter()
    metrics, curves = _single_process(console, steps, out)
    return TrainResult(1, metrics, curves, None, time.perf_counter() - start)


def _single_process(console: Console, steps: int, out: Path) -> tuple[Path, Path]:
    from autoshard.runtime.plot import plot_metrics
    from autoshard.runtime.ppo_demo import run_demo

    metrics = out / "metrics_single_process.jsonl"
    metrics.unlink(missing_ok=True)
    run_demo(steps, metrics)
    curves = plot_metrics(metrics, out / "curves_single_process.png")
    console.print(f"training curves (single process): {curves}", soft_wrap=True)
    return metrics, Path(curves)


def result_step(console: Console, result: TrainResult) -> None:
    """Stage 4: reward first vs last step, training time, where the files went."""
    from autoshard.runtime.metrics import read_metrics

    console.rule("4. result")
    rows = read_metrics(result.metrics) if result.metrics.is_file() else []
    how = "2 ranks" if result.code == 0 else "one process (fallback)"
    if rows:
        first, last = rows[0], rows[-1]
        console.print(f"reward {first['reward/mean']:.3f} at step {first['step']:.0f} → {last['reward/mean']:.3f} "
                      f"at step {last['step']:.0f}; {len(rows)} steps on {how} in {result.seconds:.0f} s "
                      "(start-up included)", markup=False, highlight=False)
    for label, path in (("metrics", result.metrics), ("plan", result.plan), ("curves", result.curves)):
        if path is not None:
            console.print(f"{label + ':':9}{path}", markup=False, highlight=False, soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when the sharded PPO run succeeded, 1 when it fell back."""
    parser = argparse.ArgumentParser(prog="python -m autoshard.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=PPO_STEPS, help=f"PPO steps (default {PPO_STEPS})")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "autoshard-demo", help="where metrics and curves go")
    parser.add_argument("--skip-plan", action="store_true", help="skip stages 1 and 2 (the 7B capture and plan)")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 140), highlight=False)
    if not args.skip_plan:
        plan_step(console, capture_step(console))
    args.out.mkdir(parents=True, exist_ok=True)
    result = ppo_step(console, args.steps, args.out)
    result_step(console, result)
    return result.code


if __name__ == "__main__":
    raise SystemExit(main())
