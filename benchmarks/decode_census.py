"""One decode step of a reference policy on a GPU: kernels per step (by name), replay time, and the counted ops the
cost model prices (``search/rollout.py`` ``decode_ops``), eager-captured and ``torch.compile``-d then captured.

    python benchmarks/decode_census.py --model llama:1.3b --batch 32 --max-len 256 [--compile] > census.json

Prints one JSON object per variant: ``kernels_per_step`` (CUDA kernels the profiler sees in one replay),
``counted_ops`` (the meta count the price uses), ``replay_ms`` (median of 50 replays), the top kernel names and,
with ``--compile``, the compile seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch


def _replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 50) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _census(graph: torch.cuda.CUDAGraph) -> tuple[int, list[tuple[str, int]]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = collections.Counter(e.name[:80] for e in prof.events() if e.device_type.name == "CUDA")
    return sum(names.values()), names.most_common(25)


def _capture(step, tokens, pos) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            step(tokens, pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        step(tokens, pos)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama:1.3b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=258)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()

    from autoshard.models import build
    from autoshard.search.rollout import _counted_decode_ops

    model = build(args.model, device="cuda", dtype=torch.bfloat16, vocab_size=args.vocab,
                  max_seq_len=args.max_len).eval()
    cache = model.new_cache(args.batch, args.max_len)
    tokens = torch.zeros(args.batch, 1, dtype=torch.long, device="cuda")
    pos = torch.full((), args.max_len - 1, dtype=torch.long, device="cuda")
    variants = [("eager", lambda t, p: model(t, cache=cache, start_pos=p))]
    if args.compile:
        compiled = torch.compile(lambda t, p: model(t, cache=cache, start_pos=p), dynamic=False, fullgraph=False)
        variants.append(("compiled", compiled))
    for name, step in variants:
        t0 = time.perf_counter()
        try:
            graph = _capture(step, tokens, pos)
        except Exception as err:  # noqa: BLE001 - reported, the other variant still runs
            print(json.dumps({"variant": name, "error": f"{type(err).__name__}: {err}"[:500]}), flush=True)
            continue
        capture_s = time.perf_counter() - t0
        kernels, top = _census(graph)
        print(json.dumps({"variant": name, "model": args.model, "batch": args.batch, "max_len": args.max_len,
                          "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "counted_ops": _counted_decode_ops(args.model), "kernels_per_step": kernels,
                          "replay_ms": _replay_ms(graph), "capture_s": round(capture_s, 1), "top": top}),
              flush=True)


if __name__ == "__main__":
    main()
