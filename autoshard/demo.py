"""``make demo``: the main job on an embedded default.

1. capture the tiny Llama-style reference policy and print its layer table;
2. show the preset cluster ``h100-sxm:1x8``;
3. plan a 7B Llama-style policy for that cluster (capture on the meta device,
   CP-SAT search) and print the plan.

The PPO stage (train the tiny policy on 2 CPU ranks) joins this demo when the
runtime lands; until then the demo stops after planning and says so.
"""

from __future__ import annotations

import time

from rich.console import Console

DEMO_CLUSTER = "h100-sxm:1x8"
DEMO_POLICY = "llama:7b"
DEMO_TRAIN = dict(global_batch=64, seq_len=4096)


def main() -> int:
    from autoshard.cluster import Cluster
    from autoshard.passes.capture import capture_reference, format_coverage, format_layer_table
    from autoshard.search import solve
    from autoshard.train import TrainSpec

    console = Console(width=max(Console().width, 140))
    console.rule("1. capture llama:tiny")
    t0 = time.perf_counter()
    tiny = capture_reference("llama:tiny")
    console.print(format_layer_table(tiny))
    console.print(format_coverage(tiny))
    console.print(f"captured in {time.perf_counter() - t0:.1f} s")

    console.rule(f"2. cluster {DEMO_CLUSTER}")
    cluster = Cluster.load(DEMO_CLUSTER)
    console.print(cluster.describe())

    console.rule(f"3. plan {DEMO_POLICY} on {DEMO_CLUSTER}, batch {DEMO_TRAIN['global_batch']} × seq {DEMO_TRAIN['seq_len']}")
    t0 = time.perf_counter()
    graph = capture_reference(DEMO_POLICY)
    t_capture = time.perf_counter() - t0
    plan = solve(graph, cluster, TrainSpec(**DEMO_TRAIN))
    console.print(plan.to_rich())
    console.print(f"capture {t_capture:.1f} s, search {plan.solver.wall_s:.1f} s ({plan.solver.status})")
    console.rule("done")
    console.print("PPO on CPU ranks is not part of this demo yet: the runtime has not landed (see README).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
