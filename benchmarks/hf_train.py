"""Train a Hugging Face Llama from a local safetensors directory under the searched plan, as a user would.

    torchrun --nproc-per-node 2 benchmarks/hf_train.py --dir /tmp/llama-1b --steps 40 --out RESULT.json

1. rank 0 writes the directory when it has no ``config.json``: a 1.1B Llama (TinyLlama's shapes:
   hidden 2048, 22 layers, 32 heads, 4 key/value heads, FFN 5632, vocab 32000) with HF's own random
   init (seed 0), ``save_pretrained`` in bf16 in 1 GB shards with an index — the files a user has;
2. every rank builds the actor-critic on meta from the directory's config (``autoshard.models.hf``:
   the HF trunk + ``lm_head`` + a value head), and ``autoshard.compile`` captures it, searches the
   plan for the detected cluster (``--calibration``: a per-machine calibration file) and builds this
   rank's program, reading only its slices of the safetensors (``Layered(Safetensors(dir),
   Initialize(0))``: the value head, which HF files lack, is initialised);
3. check: rank 0 compares the program's first logits with ``LlamaForCausalLM.from_pretrained(dir)``'s
   on the same tokens (bf16: max |Δ| / max |logit|);
4. ``--steps`` AdamW steps (``--lr``, β = (0.9, 0.95), weight decay 0.1 on matrices, ``--warmup-steps`` of
   linear warm-up then cosine to a tenth; clip 1.0) of next-token cross-entropy (+ a small value loss) on a learnable
   synthetic stream (each sequence an affine progression mod the vocabulary, random start and
   stride from a fixed set), ``global_batch`` × ``seq_len`` tokens a step;
5. rank 0 writes the plan, the predictions, the measured median step time (steps after the first
   ``--warmup``), the peak memory per rank and the loss curve to ``--out``.

``--tp N`` fixes the tensor-parallel degree the search must use (default 1; 0 leaves it to the search).
``--memory-snapshot`` records what rank 0's step holds at its peak, by allocating line (one more step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
STRIDES = (1, 3, 7, 11)


def write_model(directory: Path) -> None:
    """A random-init 1.1B Llama saved as a user's local directory (module docstring, 1)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_1B)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="1GB")
    del model
    torch.cuda.empty_cache()


def batch(step: int, rows: int, seq_len: int, vocab: int) -> torch.Tensor:
    """The global batch of ``step``: affine progressions mod ``vocab`` (learnable; module docstring, 4)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (rows, 1), generator=g)]
    return (start + stride * torch.arange(seq_len)) % vocab  # [B, S]


def loss_fn(outputs, tokens: torch.Tensor) -> torch.Tensor:
    logits, values = outputs  # [b, S, V], [b, S]
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    return lm + 0.01 * values.float().pow(2).mean()


def logits_check(directory: Path, ours: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Rank 0: the program's logits against HF's own model read from the same files (module docstring, 3)."""
    import transformers

    with torch.no_grad():
        hf = transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16).cuda().eval()
        theirs = hf(tokens.cuda()).logits.float()
        del hf
        torch.cuda.empty_cache()
    return {"max_abs_diff": float((ours - theirs).abs().max()), "max_abs_logit": float(theirs.abs().max()),
            "rms_diff_over_rms": float((ours - theirs).pow(2).mean().sqrt() / theirs.pow(2).mean().sqrt()),
            "argmax_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--calibration", type=Path)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree the search must use (0: its choice)")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="one more step under the CUDA allocator's history; the record gets memory_at_peak "
                        "(benchmarks/run.py's peak_summary: what the step allocated and held at its peak, by line)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import autoshard
    from autoshard.models.hf import actor_critic, load_hf_config
    from autoshard.runtime.materialize import Initialize, Layered, Safetensors
    from autoshard.search import Constraints

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    if rank == 0 and not (args.dir / "config.json").exists():
        write_model(args.dir)
    dist.barrier()
    written_s = time.perf_counter() - t0

    config = load_hf_config(args.dir)
    policy = actor_critic(config)  # meta, bf16: planning reads no weights
    cluster = autoshard.Cluster.detect()
    if args.calibration:
        cluster = cluster.with_calibration(args.calibration)
    train = autoshard.TrainSpec(global_batch=args.global_batch, seq_len=args.seq_len,
                                optimizer=autoshard.AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
                                lr_schedule=autoshard.LRSchedule(warmup_steps=args.warmup_steps, decay="cosine",
                                                                 total_steps=args.steps, min_lr_ratio=0.1))
    example = (torch.zeros(2, args.seq_len, dtype=torch.long, device="meta"),)  # the model is on meta
    t1 = time.perf_counter()
    compiled = autoshard.compile(policy, cluster, example_inputs=example, train=train,
                                 constraints=Constraints(mesh={"tp": args.tp}) if args.tp else None,
                                 weights=Layered(Safetensors(args.dir), Initialize(0)), name="hf-llama-1.1b")
    build_s = time.perf_counter() - t1
    program, plan = compiled.program, compiled.plan
    if rank == 0:
        print(plan, flush=True)

    check = None
    probe = batch(-1, 2, 256, config.vocab_size)
    if plan.mesh.pp == 1:  # every rank runs the forward (its collectives); rank 0 compares
        with torch.no_grad():
            ours = program(probe)[0].float()
        if rank == 0:
            check = logits_check(args.dir, ours, probe)
            print("logits check", check, flush=True)
        del ours
        dist.barrier()

    losses, times = [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        tokens = program.local_batch(batch(step, args.global_batch, args.seq_len, config.vocab_size))
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = program.step(tokens.cuda(), loss_fn)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(result.loss)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d} loss {result.loss:.4f} grad_norm {result.grad_norm:.3f} lr {result.lr:.2e} "
                  f"{times[-1]:.3f}s", flush=True)
    peak = torch.tensor([torch.cuda.max_memory_allocated()], device="cuda")
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    at_peak = None
    if args.memory_snapshot:  # after the measured steps: their peak is recorded above
        from benchmarks.run import memory_snapshot_step

        tokens = program.local_batch(batch(args.steps, args.global_batch, args.seq_len, config.vocab_size)).cuda()
        at_peak = memory_snapshot_step(lambda t: program.step(t, loss_fn), tokens, torch.device("cuda", local_rank))

    if rank == 0:
        from autoshard.search.cost_model import predict

        pred = predict(compiled.graph, plan, compiled.cluster, train)
        measured = statistics.median(times[args.warmup:])
        record = {
            "model": {"config": LLAMA_1B if config.hidden_size == LLAMA_1B["hidden_size"] else config.to_dict(),
                      "parameters": sum(p.numel() for p in policy.parameters()),
                      "files": sorted(f.name for f in args.dir.iterdir())},
            "device": torch.cuda.get_device_name(), "world_size": dist.get_world_size(),
            "torch": torch.__version__, "tp": args.tp, "plan": plan.to_dict(), "plan_summary": str(plan),
            "train": {"global_batch": args.global_batch, "seq_len": args.seq_len, "steps": args.steps, "lr": args.lr,
                      "warmup_steps": args.warmup_steps, "schedule": "cosine to 0.1", "weight_decay": 0.1},
            "write_model_s": written_s, "compile_and_build_s": build_s, "logits_check": check,
            "losses": losses, "step_s": times, "median_step_s": measured,
            "predicted_step_s": pred.step_time_s, "step_error": pred.step_time_s / measured - 1,  # as the zoo: pred/meas - 1
            "build_report": str(program.memory_report()),
            "peak_memory_bytes": [int(x) for x in peaks], "predicted_peak_memory_bytes": pred.peak_memory_bytes,
            "memory_error": pred.peak_memory_bytes / max(int(x) for x in peaks) - 1,
            "memory_breakdown": pred.memory_breakdown, "memory_at_peak": at_peak,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps({k: record[k] for k in ("median_step_s", "predicted_step_s", "step_error",
                                                 "peak_memory_bytes", "predicted_peak_memory_bytes",
                                                 "memory_error", "logits_check")}, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
