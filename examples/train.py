"""Train your own model with autoshard: data split, schedule, checkpoints, exact resume, export.

    # 1. plan once, without processes (inspect it with `autoshard inspect plan.json`)
    python examples/train.py --plan-out plan.json --cluster cpu:1x2 [--state zero3]
    # 2. launch the plan's ranks (torchrun underneath); checkpoints every --ckpt-every steps
    autoshard run plan.json -- examples/train.py --ckpt-dir runs/a --steps 40
    # 3. interrupted? the same command with --resume continues from the newest checkpoint,
    #    with the loss curve an uninterrupted run would have had
    autoshard run plan.json -- examples/train.py --ckpt-dir runs/a --steps 40 --resume
    # plain torchrun works too: without a plan every rank runs the same deterministic search
    torchrun --nproc-per-node 2 examples/train.py --ckpt-dir runs/a --steps 40

What is in it (docs/own-model.md walks through it):

| piece | where |
| --- | --- |
| the model: a user-written actor-critic, ``forward(tokens) -> (logits, values)`` | ``TinyLM`` |
| data: a synthetic token corpus, a seeded global order, each data-parallel rank its slice | ``synthetic_corpus``, ``ShardedSampler`` |
| the loss: next-token cross-entropy + a critic that predicts each token's loss | ``loss_fn`` |
| optimizer: AdamW, warm-up + cosine schedule, decoupled weight decay, clipping (``TrainSpec``) | ``train_spec`` |
| plan: ``AUTOSHARD_PLAN`` (``autoshard run``), ``--plan``, or a search (``--state`` pins every layer) | ``compile_program`` |
| checkpoints: weights, AdamW moments and step, schedule, RNG, data position | ``save_checkpoint``, ``resume`` |
| export: the full model as one safetensors file (rank 0, no process group) | end of ``train`` |

``main(argv)`` also runs inside an existing process group (the tests call it so) and returns
what it did: one record per step (loss, grad norm, learning rate), the checkpoints, the export.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.runtime import checkpoint as ckpt
from autoshard.runtime.launch import PLAN_ENV
from autoshard.runtime.launch_child import timeout_s
from autoshard.runtime.materialize import Initialize
from autoshard.search import Constraints
from autoshard.train import LR_DECAYS, PRECISIONS

STATES = ("replicate", "zero1", "zero2", "zero3", "offload")
CHECKPOINT_NAME = re.compile(r"step_(\d{6})")  # committed checkpoints only (a save in flight is "step_….tmp-…")


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 2
    max_seq_len: int = 64


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv, self.proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.up, self.down = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, S, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    """A small actor-critic: token + position embeddings, blocks, an LM head and a value head.

    The contract autoshard trains: ``forward(tokens [B, S] int64) -> (logits [B, S, V], values [B, S])``,
    tensors only (no cache, no dict), no data-dependent Python control flow.
    """

    def __init__(self, cfg: TinyConfig = TinyConfig()) -> None:
        super().__init__()
        self.config = cfg  # autoshard reads config.vocab_size / max_seq_len where present
        self.tok, self.pos = nn.Embedding(cfg.vocab_size, cfg.dim), nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.value_head = nn.Linear(cfg.dim, 1)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))  # (B, S, D)
        for block in self.blocks:
            x = block(x)
        x = self.ln(x)
        return self.lm_head(x), self.value_head(x).squeeze(-1)


def loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, plus 0.1 × a critic regressed on each position's (detached) loss."""
    logits, values = outputs
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
    nll = nll.view(tokens.shape[0], -1)  # (B, S-1)
    return nll.mean() + 0.1 * F.mse_loss(values[:, :-1].float(), nll.detach())


# --------------------------------------------------------------------------- data


def synthetic_corpus(num_samples: int, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """``[num_samples, seq_len]`` tokens of a seeded Markov chain: each token is followed by its fixed
    successor (one random permutation of the vocabulary) with probability 0.9, else by a uniform token.
    Learnable from the previous token alone, so the loss falls within tens of steps."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab_size, generator=gen)
    tokens = torch.empty(num_samples, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (num_samples,), generator=gen)
    for t in range(1, seq_len):
        noise = torch.randint(0, vocab_size, (num_samples,), generator=gen)
        keep = torch.rand(num_samples, generator=gen) < 0.9
        tokens[:, t] = torch.where(keep, successor[tokens[:, t - 1]], noise)
    return tokens


class ShardedSampler:
    """A seeded global order of the samples; each data-parallel rank takes its slice of every global batch.

    Epoch ``e`` visits the samples in ``randperm(n, seed + e)``; global batch ``b`` of the epoch is
    ``order[b*G:(b+1)*G]`` (the tail short of ``G`` is dropped), and dp rank ``r`` of ``D`` takes
    rows ``[r*G/D, (r+1)*G/D)`` of it, the slice ``Program.local_batch`` would cut. The position
    (epoch, batches taken) is the whole state: saved in checkpoints, it resumes the same stream,
    and since it counts global batches, a resume under another dp size reads the same data.
    """

    def __init__(self, num_samples: int, global_batch: int, dp_rank: int, dp_size: int, seed: int) -> None:
        if global_batch % dp_size or global_batch > num_samples:
            raise ValueError(f"global batch {global_batch} must divide by dp={dp_size} and fit {num_samples} samples")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.local = global_batch // dp_size
        self.offset = dp_rank * self.local
        self.epoch, self.batch = 0, 0  # position: batches of this epoch already taken
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order), computed once per epoch

    def next_rows(self) -> torch.Tensor:
        """Sample indices of this rank's slice of the next global batch."""
        if self.batch == self.num_samples // self.global_batch:
            self.epoch, self.batch = self.epoch + 1, 0
        if self._order is None or self._order[0] != self.epoch:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order = (self.epoch, torch.randperm(self.num_samples, generator=gen))
        order = self._order[1]
        start = self.batch * self.global_batch + self.offset
        self.batch += 1
        return order[start:start + self.local]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


# --------------------------------------------------------------------------- plan and program


def train_spec(args: argparse.Namespace) -> autoshard.TrainSpec:
    """The step the plan is made for, and the optimizer the runtime runs."""
    return autoshard.TrainSpec(
        global_batch=args.global_batch, seq_len=args.seq_len, precision=args.precision,
        optimizer=autoshard.AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay),
        lr_schedule=autoshard.LRSchedule(warmup_steps=args.warmup, decay=args.decay, total_steps=args.steps,
                                         min_lr_ratio=args.min_lr_ratio),
        grad_clip=args.grad_clip,
    )


def pins_for(model: nn.Module, example: tuple, state: str | None) -> Constraints | None:
    """``--state``: every layer pinned to one ZeRO state, no tensor or pipeline parallelism."""
    if state is None:
        return None
    from autoshard.passes.capture import capture

    graph = capture(model, example)
    return Constraints(pin={layer.name: {"state": state, "tp": "none"} for layer in graph.layers},
                       mesh={"tp": 1, "pp": 1})


def compile_program(args: argparse.Namespace) -> autoshard.Compiled:
    """Plan mode without a process group; under one, this rank's program (weights initialised on shards)."""
    with torch.device("meta"):  # no rank ever holds the whole model: each initialises its own shards
        model = TinyLM(TinyConfig(max_seq_len=max(64, args.seq_len)))
    example = (torch.zeros(2, args.seq_len, dtype=torch.long, device="meta"),)
    plan = args.plan or os.environ.get(PLAN_ENV)
    cluster = args.cluster
    if cluster is None:
        if plan is None:
            world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
            cluster = f"cpu:1x{world}"
        else:
            from autoshard.plan_reuse import cluster_of

            cluster = cluster_of(autoshard.Plan.load(plan))  # the cluster the plan was made for
    return autoshard.compile(model, cluster, example_inputs=example, train=train_spec(args), plan=plan,
                             constraints=None if plan else pins_for(model, example, args.state),
                             weights=Initialize(seed=args.seed))


# --------------------------------------------------------------------------- checkpoints


def newest_checkpoint(directory: Path) -> Path | None:
    steps = [p for p in directory.glob("step_*") if CHECKPOINT_NAME.fullmatch(p.name)] if directory.is_dir() else []
    return max(steps, key=lambda p: p.name, default=None)


def save_checkpoint(directory: Path, program: Any, step: int, sampler: ShardedSampler, fingerprint: str,
                    keep: int) -> Path:
    """Save ``step_<step>`` (collective, atomic) and keep the newest ``keep`` checkpoints."""
    state = ckpt.program_state(program, step=step, extras={"sampler": sampler.state_dict()},
                               model_fingerprint=fingerprint)
    path = ckpt.save(directory / f"step_{step:06d}", state)
    if dist.get_rank() == 0:
        done = sorted(p for p in directory.glob("step_*") if CHECKPOINT_NAME.fullmatch(p.name))
        for old in done[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return path


def resume(path: Path, program: Any, sampler: ShardedSampler, fingerprint: str) -> int:
    """Load weights, AdamW moments and step, RNG and data position from ``path`` (any plan); the step reached."""
    loaded = ckpt.load_program(path, program, model_fingerprint=fingerprint)
    sampler.load_state_dict(loaded.extras["sampler"])
    return loaded.step


# --------------------------------------------------------------------------- the loop


def train(args: argparse.Namespace) -> dict[str, Any]:
    compiled = compile_program(args)
    program, fingerprint = compiled.program, compiled.graph.fingerprint()
    rank = dist.get_rank()
    corpus = synthetic_corpus(args.samples, args.seq_len, TinyConfig.vocab_size, args.seed)
    sampler = ShardedSampler(len(corpus), args.global_batch, program.ctx.coord("dp"), program.ctx.size("dp"),
                             args.seed)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else None
    start = 0
    if args.resume and ckpt_dir is not None and (latest := newest_checkpoint(ckpt_dir)) is not None:
        start = resume(latest, program, sampler, fingerprint)
        if rank == 0:
            print(f"resumed from {latest} at step {start}", flush=True)
    history, saved = [], []
    stop = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    for step in range(start + 1, stop + 1):
        result = program.step(corpus[sampler.next_rows()], loss_fn)
        record = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr}
        history.append(record)
        if rank == 0 and args.metrics:
            Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
            with open(args.metrics, "a") as out:
                out.write(json.dumps(record) + "\n")
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step:5d}  loss {result.loss:.4f}  grad_norm {result.grad_norm:.3f}  lr {result.lr:.2e}",
                  flush=True)
        if ckpt_dir is not None and (step % args.ckpt_every == 0 or step == args.steps):
            saved.append(str(save_checkpoint(ckpt_dir, program, step, sampler, fingerprint, args.keep)))
    exported = None
    if args.export and saved and stop == args.steps:
        if rank == 0:  # reads the checkpoint without a process group: the full model in this one process
            exported = str(ckpt.export_safetensors(saved[-1], args.export))
        dist.barrier()
    return {"start": start, "history": history, "checkpoints": saved, "export": exported,
            "plan_states": sorted({layer.state for layer in program.plan.layers})}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--steps", type=int, default=40, help="training steps; the schedule's total_steps")
    add("--global-batch", type=int, default=8)
    add("--seq-len", type=int, default=32)
    add("--samples", type=int, default=256, help="size of the synthetic corpus")
    add("--lr", type=float, default=1e-2, help="peak learning rate")
    add("--warmup", type=int, default=5, help="warm-up steps")
    add("--decay", default="cosine", choices=LR_DECAYS)
    add("--min-lr-ratio", type=float, default=0.1)
    add("--weight-decay", type=float, default=0.1, help="decoupled, on matrices and embeddings only")
    add("--grad-clip", type=float, default=1.0)
    add("--precision", default="bf16" if torch.cuda.is_available() else "fp32", choices=PRECISIONS)
    add("--seed", type=int, default=0, help="weights, corpus and data order")
    add("--plan", help="plan JSON (default: AUTOSHARD_PLAN from `autoshard run`, else search)")
    add("--plan-out", help="plan mode: search, write the plan here and exit (no process group)")
    add("--cluster", help="cluster spec or file (default: the plan's, else cpu:1x<WORLD_SIZE>)")
    add("--state", choices=STATES, help="search with every layer pinned to this state")
    add("--ckpt-dir", help="checkpoints go to CKPT_DIR/step_<n>")
    add("--ckpt-every", type=int, default=10)
    add("--keep", type=int, default=2, help="checkpoints kept")
    add("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir, if any")
    add("--stop-after", type=int, help="stop after this step, as if interrupted (no extra checkpoint)")
    add("--export", help="after the last step, write the model as one safetensors file here")
    add("--metrics", help="append one JSON line per step here (rank 0)")
    add("--log-every", type=int, default=10)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.plan_out:
        compiled = compile_program(args)
        compiled.plan.save(args.plan_out)
        print(compiled.plan)
        return None
    own_group = not dist.is_initialized()
    if own_group:  # under torchrun / autoshard run; the tests call main inside their own group
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # a peer that stops answering fails the collective after AUTOSHARD_TIMEOUT_S (runtime/launch.py)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s()))
    try:
        return train(args)
    finally:
        if own_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
