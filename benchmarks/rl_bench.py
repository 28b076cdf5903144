"""RL-step measurements beside ``autoshard ppo`` (``benchmarks/rl_campaign.sh``).

Subcommands:

* ``prompts --len P --count N --out FILE``: a JSONL of N prompts of P bytes each (the bytes tokenizer:
  one token per byte), seeded.
* ``floor --model SPEC --batch B --prompt P --new R``: the floor to beat: one GPU, a plain Hugging Face
  ``LlamaForCausalLM`` of the same shape (random weights, bf16) sampling B sequences of R new tokens
  with its KV cache (``generate(do_sample=True, min_new_tokens=R)``); prints one JSON line with tokens/s.
* ``reshard --model SPEC --tp-train T`` (under torchrun): a ZeRO-3 (T = 1) or Megatron-tp × ZeRO-3 training
  program of SPEC over the job, and for each rollout tp r the time of ``RolloutEngine.sync`` (median of 5
  after a warm-up) against the bytes each rank receives (``search/rollout.reshard``) and those bytes over the
  intra-node link's bandwidth (the physical limit); rank 0 prints one JSON line per r.

``length_reward`` is the campaign's reward: response length in bytes / 100 (any reward times the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

VOCAB = 258  # the bytes tokenizer's vocabulary (256 bytes, <pad>, <eos>)


def length_reward(prompts, responses, references, response_ids):
    """Response length in bytes / 100, one float per response."""
    return [len(r) / 100.0 for r in responses]


def cmd_prompts(args: argparse.Namespace) -> int:
    gen = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789 "
    with open(args.out, "w") as f:
        for _ in range(args.count):
            idx = torch.randint(0, len(letters), (args.len,), generator=gen).tolist()
            f.write(json.dumps({"prompt": "".join(letters[i] for i in idx)}) + "\n")
    return 0


def _config(spec: str):
    from autoshard.models import config_for

    return config_for(spec, vocab_size=VOCAB)


def cmd_floor(args: argparse.Namespace) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = _config(args.model)
    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=c.hidden, intermediate_size=c.ffn_hidden, num_hidden_layers=c.num_layers,
                     num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads or c.num_heads,
                     max_position_embeddings=args.prompt + args.new + 8, tie_word_embeddings=c.tie_embeddings,
                     eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf).to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    ids = torch.randint(0, 256, (args.batch, args.prompt), device=device)

    def once() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=args.new,
                                 min_new_tokens=args.new, use_cache=True)
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == args.prompt + args.new, out.shape
        return time.perf_counter() - start

    once()  # warm-up
    times = [once() for _ in range(args.repeats)]
    seconds = statistics.median(times)
    print(json.dumps({"kind": "floor", "model": args.model, "batch": args.batch, "prompt": args.prompt, "new": args.new,
                      "seconds": seconds, "tokens_per_s": args.batch * args.new / seconds, "times": times,
                      "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}), flush=True)
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from autoshard.cluster_detect import detect_dict
    from autoshard.cluster import Cluster
    from autoshard.models import build
    from autoshard.plan import LayerStrategy, Mesh, Plan
    from autoshard.runtime.ppo_program import capture_policy
    from autoshard.runtime.build_options import BuildOptions
    from autoshard.runtime.program import build_program
    from autoshard.runtime.rollout_engine import RolloutEngine
    from autoshard.search.rollout import reshard
    from autoshard.train import TrainSpec

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    model = build(args.model, device="meta", vocab_size=VOCAB)
    graph = capture_policy(model, args.model)
    tp = args.tp_train
    mesh = Mesh(dp_shard=world // tp, tp=tp)
    layers = tuple(LayerStrategy(layer=l.name, state="zero3",
                                 tp="megatron" if tp > 1 and l.kind in ("attention", "mlp", "embedding", "head") else "none")
                   for l in graph.layers)
    precision = "bf16" if cuda else "fp32"
    plan = Plan(model_name=args.model, mesh=mesh, layers=layers, precision=precision)
    program = build_program(model, graph, plan, TrainSpec(global_batch=world, seq_len=64, precision=precision),
                            device=f"cuda:{local}" if cuda else "cpu", options=BuildOptions(compile=False))
    cluster = Cluster.from_dict(detect_dict()) if cuda else None
    rows = []
    for r in args.rollout:
        if (world % r) or r > world:
            continue
        engine = RolloutEngine.for_program(program, model, tp=r)
        engine.sync(0)
        times = []
        for version in range(1, 6):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            engine.sync(version)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        row = {"kind": "reshard", "model": args.model, "world": world, "train_mesh": str(mesh), "rollout_tp": r,
               "seconds": statistics.median(times), "times": times}
        if cluster is not None:
            priced = reshard(graph, cluster, plan, r)
            link = cluster.intra_node
            row.update(predicted_s=priced["reshard_s"], bytes_received=priced["reshard_bytes"],
                       link_bandwidth=link.bandwidth, physical_limit_s=priced["reshard_bytes"] / link.bandwidth,
                       device=torch.cuda.get_device_name(0))
        rows.append(row)
        del engine
        if cuda:
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--len", type=int, default=128)
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--out", required=True)
    f = sub.add_parser("floor")
    f.add_argument("--model", required=True)
    f.add_argument("--batch", type=int, default=64)
    f.add_argument("--prompt", type=int, default=128)
    f.add_argument("--new", type=int, default=128)
    f.add_argument("--repeats", type=int, default=3)
    r = sub.add_parser("reshard")
    r.add_argument("--model", required=True)
    r.add_argument("--tp-train", type=int, default=1)
    r.add_argument("--rollout", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    return {"prompts": cmd_prompts, "floor": cmd_floor, "reshard": cmd_reshard}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
