"""``make demo``: plan a 7B policy for an H100 node, then train a tiny one with PPO on 2 CPU ranks.

1. **plan**: capture a 7B Llama-style policy on the meta device and search
   its plan for the preset cluster ``h100-sxm:1x8`` (CP-SAT); print the plan.
2. **PPO**: ``autoshard ppo llama:tiny --cluster cpu:1x2`` — search a plan for
   two gloo ranks on this machine, start them through torchrun, and train the
   reference run (``runtime/ppo_demo.py``: arithmetic sequences, reward from
   ≈ 0.07 to ≈ 0.75 in 150 steps) with one live line per step; it ends with
   the path of the training-curves PNG.

If the sharded 2-rank run fails (exit code ≠ 0), the demo says so on screen
and falls back to the single-process reference run (``run_demo``), which
trains the same policy without the sharded runtime.

``python -m autoshard.demo --steps N --out DIR [--skip-plan]`` shortens it
(the smoke test uses a few steps).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Sequence

from rich.console import Console

DEMO_CLUSTER = "h100-sxm:1x8"
DEMO_POLICY = "llama:7b"
DEMO_TRAIN = dict(global_batch=64, seq_len=4096)
PPO_MODEL = "llama:tiny"
PPO_CLUSTER = "cpu:1x2"
PPO_STEPS = 150


def plan_step(console: Console) -> None:
    """Step 1: capture ``DEMO_POLICY`` on meta, search its plan for ``DEMO_CLUSTER``, print it."""
    from autoshard.cluster import Cluster
    from autoshard.passes.capture import capture_reference
    from autoshard.search import solve
    from autoshard.train import TrainSpec

    console.rule(f"1. plan {DEMO_POLICY} on {DEMO_CLUSTER}, batch {DEMO_TRAIN['global_batch']} × seq {DEMO_TRAIN['seq_len']}")
    cluster = Cluster.load(DEMO_CLUSTER)
    t0 = time.perf_counter()
    graph = capture_reference(DEMO_POLICY)
    t_capture = time.perf_counter() - t0
    plan = solve(graph, cluster, TrainSpec(**DEMO_TRAIN))
    console.print(plan.to_rich())
    console.print(f"capture {t_capture:.1f} s, search {plan.solver.wall_s:.1f} s ({plan.solver.status})")


def ppo_step(console: Console, steps: int, out: Path) -> int:
    """Step 2: ``autoshard ppo`` on 2 CPU ranks; falls back to single-process PPO if it fails. Exit code."""
    from autoshard.cli import main as cli_main

    console.rule(f"2. PPO: {PPO_MODEL} on {PPO_CLUSTER} (2 gloo ranks), {steps} steps")
    metrics, curves = out / "metrics.jsonl", out / "curves.png"
    metrics.unlink(missing_ok=True)  # the writer appends; a demo starts fresh
    argv = ["ppo", PPO_MODEL, "--cluster", PPO_CLUSTER, "--steps", str(steps),
            "--metrics", str(metrics), "--plot", str(curves)]
    code = cli_main(argv)
    if code == 0:
        return 0
    console.print(f"[bold red]the sharded 2-rank PPO run failed (exit code {code}); falling back to the "
                  "single-process reference run (runtime/ppo_demo.py), NOT the sharded runtime[/]", soft_wrap=True)
    return _single_process(console, steps, out)


def _single_process(console: Console, steps: int, out: Path) -> int:
    from autoshard.plot import plot_metrics
    from autoshard.runtime.ppo_demo import run_demo

    metrics = out / "metrics_single_process.jsonl"
    metrics.unlink(missing_ok=True)
    run_demo(steps, metrics)
    curves = plot_metrics(metrics, out / "curves_single_process.png")
    console.print(f"training curves (single process): {curves}", soft_wrap=True)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when the sharded PPO run succeeded, 1 when it fell back."""
    parser = argparse.ArgumentParser(prog="python -m autoshard.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=PPO_STEPS, help=f"PPO steps (default {PPO_STEPS})")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "autoshard-demo", help="where metrics and curves go")
    parser.add_argument("--skip-plan", action="store_true", help="skip step 1 (the 7B plan)")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 140))
    if not args.skip_plan:
        plan_step(console)
    args.out.mkdir(parents=True, exist_ok=True)
    code = ppo_step(console, args.steps, args.out)
    console.rule("done")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
