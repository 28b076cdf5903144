"""Re-price a recorded RL campaign's plans with the current cost model (no GPU needed).

    python benchmarks/rl_reprice.py FOLDER        # an unpacked rl_campaign.sh output (or its campaign.tgz)

For every ``x*.plan.json`` with a rollout section and its ``x*.jsonl`` metrics, this prices the same training
plan and rollout layout again (``search/rollout.price``: the model captured on ``meta`` as ``autoshard ppo``
captures it with the campaign's bytes tokenizer (258 ids), the folder's ``cluster_xN.json`` with its
``cal.json``, the recorded workload; PPO with compiled programs, as ``rl_campaign.sh`` runs it: the run files
record neither ``--compile`` nor the algorithm) and prints the measured phases beside the recorded and the
re-priced prediction. The plan is not searched again: its error is about the plan that ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

PRICED = {"generate": "generate_s", "reshard": "reshard_s", "score": "score_s", "advantages": "advantages_s",
          "train": "train_s", "step": "rl_step_s"}


def reprice(folder: Path) -> list[dict]:
    from benchmarks.rl_summary import measured_phases
    from autoshard.cli_search import load_cluster
    from autoshard.plan import Plan
    from autoshard.runtime.ppo_program import capture_policy, load_policy
    from autoshard.search import rollout as R

    out = []
    for plan_file in sorted(folder.glob("x*.plan.json")):
        metrics = plan_file.with_name(plan_file.name.replace(".plan.json", ".jsonl"))
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        rows = [r for r in rows if "time/step" in r]  # measured_phases leaves out the first (it compiles)
        plan = Plan.load(plan_file)
        if not rows or not plan.rollout:
            continue
        roll = plan.rollout[0]
        world = plan.mesh.world_size
        cluster = load_cluster(str(folder / f"cluster_x{world}.json"), folder / "cal.json")
        policy = load_policy(plan.model_name, 0, "meta", vocab_size=258, context=roll.prompt_len + roll.response_len)
        graph = capture_policy(policy.module, policy.name)
        work = R.RolloutWorkload(sequences=roll.sequences, prompt_len=roll.prompt_len, response_len=roll.response_len,
                                 epochs=roll.epochs, mini_batches=roll.mini_batches, compiled=True)
        option = R.price(graph, cluster, plan, roll.tp, work)
        out.append({"run": plan_file.name.split(".plan")[0], "model": plan.model_name, "world": world, "tp": roll.tp,
                    "measured": measured_phases(rows),
                    "recorded": {k: getattr(roll.chosen, f) for k, f in PRICED.items()},
                    "repriced": {k: getattr(option, f) for k, f in PRICED.items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.rl_summary import PHASES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    folder = args.folder
    with tempfile.TemporaryDirectory() as tmp:
        if (folder / "campaign.tgz").exists():
            with tarfile.open(folder / "campaign.tgz") as tar:
                tar.extractall(tmp, filter="data")
            folder = Path(tmp)
        rows = reprice(folder)
    print("| run | model | GPUs | rollout tp | phase | measured | recorded prediction | re-priced |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        for phase in PHASES:
            m, rec, new = row["measured"][phase], row["recorded"][phase], row["repriced"][phase]
            err = f" ({(new - m) / m:+.1%})" if phase == "step" and m > 0 else ""
            print(f"| {row['run']} | {row['model']} | {row['world']} | {row['tp']} | {phase} | {m:.4g} | {rec:.4g} | {new:.4g}{err} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
