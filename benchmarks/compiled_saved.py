"""Saved activations of a compiled training graph, estimated on the meta device.

The cost model's activations are measured from the eager model (``passes/_capture_saved.py``);
the runtime compiles the per-rank graph on CUDA (docs/runtime.md), and inductor's partitioner
(``min_cut_rematerialization_partition``) saves fewer tensors, recomputing cheap elementwise
chains in the backward. This script asks that partitioner what it would save: it compiles one
training step (forward, next-token loss and value loss, as ``benchmarks/baselines/common.py``)
of the reference model with 1 and 2 blocks on ``meta`` tensors, through ``aot_autograd`` with
the default partitioner (what eager autograd keeps, closely) and with the min-cut one, under
``GpuKernelProfile`` (flash SDPA and CUDA dropout, as a GPU runs). It sums the bytes of the
forward graph's saved outputs that are not inputs (parameters), counting a storage once
(views are followed to their base), and reports the per-block difference and the rest.

    python benchmarks/compiled_saved.py --model llama:1.3b --seq 1024 --micro-batch 8

What it does not see: the loss's transient peak (logits and their fp32 copies live only during
the loss, the largest single term at 32k-50k vocabularies) and inductor's own buffer reuse.
Measured on 2×H100 (2026-11-26): compiled Llama-1.3B at micro-batch 8 peaked 7.7 GiB below the
eager run; this estimate gives 24 × 216 MiB = 5.1 GiB per rank from the blocks (Llama-350M:
3.3 GiB measured, 2.5 GiB estimated), so the blocks explain most but not all of it
(docs/cost-model.md, "Known limits").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoshard.models import build  # noqa: E402
from autoshard.passes._capture_saved import GpuKernelProfile  # noqa: E402

_VIEWS = ("view", "_unsafe_view", "t", "transpose", "detach", "permute", "reshape", "expand", "alias")


def _base(node):
    """The node whose storage ``node`` views (itself when it is not a view)."""
    while node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _VIEWS:
        node = node.args[0]
    return node


def saved_bytes(spec: str, num_layers: int, seq: int, micro_batch: int, partition, attn: str | None = None) -> int:
    """Bytes the forward graph of one training step saves for backward (module docstring)."""
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    model = build(spec, device="meta", dtype=torch.bfloat16, num_layers=num_layers,
                  **({"attn_impl": attn} if attn else {}))
    total = []

    def forward_compiler(gm, _inputs):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        seen = set()
        for node in output.args[0][1:]:  # the first output is the loss itself
            value = node.meta.get("val") if hasattr(node, "meta") else None
            base = _base(node) if isinstance(value, torch.Tensor) else None
            if base is None or base.op == "placeholder" or base in seen:
                continue
            seen.add(base)
            total.append(value.numel() * value.element_size())
        return gm.forward

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _inputs: gm.forward,
                           partition_fn=partition)
    tokens = torch.randint(0, 100, (micro_batch, seq), device="meta")

    def step(t: torch.Tensor) -> torch.Tensor:
        logits, values = model(t)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), t[:, 1:].reshape(-1))
        return loss + values.float().pow(2).mean()

    with GpuKernelProfile():
        torch.compile(step, backend=backend)(tokens)
    return sum(total)


def main(argv: list[str] | None = None) -> int:
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:1.3b")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--attn", choices=("sdpa", "math"))
    args = p.parse_args(argv)
    mib = 2 ** 20
    print(f"{args.model}, seq {args.seq}, micro-batch {args.micro_batch}: saved for backward, MiB")
    print("| partitioner | per block | rest (embedding, head, loss) |\n|---|---|---|")
    for name, partition in (("default (eager-like)", default_partition),
                            ("min-cut (inductor)", min_cut_rematerialization_partition)):
        one, two = (saved_bytes(args.model, n, args.seq, args.micro_batch, partition, args.attn) for n in (1, 2))
        print(f"| {name} | {(two - one) / mib:.1f} | {(2 * one - two) / mib:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
