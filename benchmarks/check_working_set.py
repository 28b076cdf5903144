"""The backward's working set against ``autoshard check``'s traced step peaks: small plans on CPU, meta.

Each case builds a 4-layer reference model at h 512 (bf16, on meta), captures it, writes a plan by hand
and runs ``autoshard/check.check_plan`` (two roles at most): the traced forward/backward and optimizer-step
peak of each role against the cost model's prediction. The cases are the ones where the working set
binds: ZeRO-3 over dp_shard 2, one stage or two (1F1B), with and without full recompute, one to four
micro-batches; and DDP. Prints one row per case and writes them as JSON (``--out``).

    .venv/bin/python benchmarks/check_working_set.py --out benchmarks/results/<campaign>/working_set.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from autoshard.check import check_plan  # noqa: E402
from autoshard.models import build  # noqa: E402
from autoshard.passes import capture  # noqa: E402
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule  # noqa: E402
from autoshard.train import TrainSpec  # noqa: E402

CONFIG = dict(hidden=512, ffn_hidden=1024, num_heads=8, num_kv_heads=8, num_layers=4, vocab_size=512, max_seq_len=512)
# (family, state, dp_shard/replicate, pp, recompute of blocks, micro-batch, micro-batches)
CASES = [
    ("llama", "zero3", 2, 1, "none", 1, 1),
    ("llama", "zero3", 2, 1, "none", 4, 1),
    ("llama", "zero3", 2, 2, "none", 2, 2),
    ("llama", "zero3", 2, 2, "full", 4, 2),
    ("llama", "replicate", 2, 1, "none", 2, 2),
    ("moe", "zero3", 2, 1, "none", 1, 1),
    ("moe", "zero3", 2, 2, "none", 2, 2),
    ("moe", "zero3", 2, 2, "full", 2, 4),
    ("moe", "zero3", 2, 2, "full", 4, 2),
    ("moe", "zero3", 2, 2, "full", 1, 8),
]


# Hugging Face models of the zoo (``benchmarks/hf_zoo.py``, random weights), at the reference models' width
HF_CONFIG = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8,
                 num_hidden_layers=4, vocab_size=512, max_position_embeddings=512)
HF_CASES = [
    ("hf-llama", "zero3", 2, 1, "none", 4, 1),
    ("hf-llama", "zero3", 2, 2, "full", 4, 2),
    ("hf-qwen2", "zero3", 2, 2, "none", 2, 2),
    ("hf-mixtral", "zero3", 2, 2, "full", 2, 2),
]


def _stages(graph, pp: int) -> list[int]:
    """Blocks split evenly over ``pp`` stages; layers before the first block on the first, the rest on the last."""
    blocks = 1 + max(l.block for l in graph.layers if l.block is not None)
    seen = False
    out = []
    for layer in graph.layers:
        seen = seen or layer.block is not None
        out.append(layer.block * pp // blocks if layer.block is not None else (pp - 1 if seen else 0))
    return out


def _model(family: str):
    if family.startswith("hf-"):
        from benchmarks.hf_zoo import build_hf_policy

        overrides = dict(HF_CONFIG)
        if family == "hf-mixtral":  # four experts, top-2, on the zoo's batched matmuls
            overrides.update(num_local_experts=4, num_experts_per_tok=2)
        return build_hf_policy(f"{family}:tiny", dtype=torch.bfloat16, **overrides)
    return build(f"{family}:tiny", device="meta", dtype=torch.bfloat16, **CONFIG)


def run_case(family: str, state: str, dp: int, pp: int, recompute: str, micro: int, count: int,
             unpriced: bool = False) -> dict:
    model = _model(family)
    graph = capture(model, seq_lens=(8, 16))
    if unpriced:  # the cost model before the working set was measured
        graph = replace(graph, layers=tuple(replace(l, grad_working_per_token=0.0, grad_working_end_per_token=0.0,
                                                    grad_working_param_fraction=0.0) for l in graph.layers))
    layers = tuple(LayerStrategy(layer=l.name, state=state, stage=stage,
                                 recompute=recompute if l.block is not None else "none")
                   for l, stage in zip(graph.layers, _stages(graph, pp)))
    mesh = Mesh(dp_shard=dp, pp=pp) if state != "replicate" else Mesh(dp_replicate=dp, pp=pp)
    batch = micro * count * dp
    plan = Plan(model_name=graph.model_name, mesh=mesh, layers=layers, precision="bf16", global_batch=batch,
                seq_len=512, schedule=Schedule(micro_batch=micro,
                                               num_micro_batches=count))
    start = time.perf_counter()
    report = check_plan(plan, model, graph, TrainSpec(global_batch=batch, seq_len=512, precision="bf16"), max_roles=2)
    worst = max(report.roles, key=lambda r: abs(r.step_error))
    return {"family": family, "state": state, "dp": dp, "pp": pp, "recompute": recompute, "micro_batch": micro,
            "micro_batches": count, "collectives_match": report.collective_mismatch is None,
            "step_errors": [round(r.step_error, 4) for r in report.roles], "worst_step_error": round(worst.step_error, 4),
            "check_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--only", type=int, nargs="*", help="case indices")
    parser.add_argument("--unpriced", action="store_true", help="price no backward working set (the earlier model)")
    args = parser.parse_args()
    rows = []
    for index, case in enumerate(CASES + HF_CASES):
        if args.only and index not in args.only:
            continue
        row = run_case(*case, unpriced=args.unpriced)
        rows.append(row)
        print(f"{index:2d} {' '.join(str(c) for c in case):32s} step errors {row['step_errors']}  {row['check_s']} s",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": CONFIG, "working_set_priced": not args.unpriced, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
