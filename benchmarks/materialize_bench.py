"""Sharded materialisation benchmark: build, initialise or load, and train a plan without a whole model on any rank.

One run per process launch, under torchrun (one process per GPU)::

    torchrun --standalone --nproc-per-node 2 benchmarks/materialize_bench.py --model hf-llama:7b \\
        --cluster h100-sxm:1x2 --weights safetensors --steps 20 --seq 1024 --batch 8 --out DIR

On the CPU (gloo, tiny models; what the tests rehearse): ``--device cpu --model llama:tiny
--cluster cpu:1x2 --precision fp32 --seq 16 --batch 4``.

Steps of a run (progress lines on rank 0 with the seconds since start):

1. the model on the meta device (``--model``: a reference spec, ``llama:7b``, or a Hugging Face
   trunk, ``hf-llama:7b`` or another ``hf-*`` spec of ``benchmarks/hf_zoo.py``): one fp32 copy to build from, one in
   the compute dtype to capture (16-bit saved activations, as ``benchmarks/run.py`` captures);
2. capture on meta, then rank 0 searches the plan for ``--cluster`` (its presets' cards: 80 GB
   for ``h100-sxm``) under the benchmark pins (``baselines/autoshard_trainer.plan_constraints``:
   pp = cp = ep = 1, no recompute or SP, uncompressed communication) and broadcasts it;
3. weights: ``--weights meta`` lets ``build_program`` initialise each rank's shards (seed 0);
   ``--weights safetensors`` first has rank 0 write random weights as a Hugging Face-style
   sharded directory (``--weights-dir``, local disk, reused when a previous run wrote the same
   model and seed; ``runtime._safetensors_source.write_sharded``) and every rank then builds
   from it. Rank 0 draws one parameter at a time on its device with a seeded ``torch.Generator``
   (``init_rule``'s distribution, bf16) and moves it to host memory: no GPU ever holds more
   than one parameter, the host holds the whole bf16 state while it is written. These values
   are NOT those of the meta run's initialisation (counter-based, ``autoshard.init``): the two
   runs' losses are not comparable step for step;
4. ``build_program(model, graph, plan, cluster, train, weights=..., device=cuda:LOCAL_RANK)``
   timed (slowest rank); its build peak is the one it measures itself (``Program.memory_report``);
5. ``--steps`` AdamW steps (bf16 compute, fp32 masters) on random tokens (``common.make_batches``)
   with ``common.policy_loss``, the peak counter reset after the build: the step peak; step times
   are the slowest rank's (``common.measure``), summarised over the steps after ``--warmup``;
6. rank 0 appends one JSON line to ``OUT/materialize.jsonl`` (``row`` below), also when a step
   failed (``status``).

``--baseline fsdp2`` (or ``fsdp2-noreshard``, ``fsdp2-noreshard-compiled``) runs the hand-written
FSDP2 baseline instead of steps 2-4, built torchtitan's way: ``fully_shard`` of the meta model,
``to_empty``, each rank initialising its own shards (``baselines/fsdp2.py``, "Meta build"); the
same batches, loss, timing and memory counters (``torch.optim.AdamW`` creates its moments in the
first step, so FSDP2's count in its step peak, where autoshard's build already holds its own). Its
``predicted_*`` fields are those of the
nearest autoshard plan (ZeRO-3, or ZeRO-2 without resharding, on every layer).

Row fields: ``model, config (autoshard | fsdp2...), weights, cluster, world_size, card, torch,
transformers, date, seq, batch, steps, warmup, precision, lr, compile, device, plan (label), mesh, states (layer
count per state), state_runs (layer-order runs of one state), predicted_peak_gib,
predicted_build_peak_gib, predicted_step_ms, build_peak_gib, step_peak_gib (max over ranks;
the build peak of an autoshard run is its ``Program.memory_report().build_peak_bytes``, on CUDA
``max_memory_allocated`` between the reset at the build's start and its end, on the CPU the
runtime's live-bytes count; FSDP2's is ``max_memory_allocated`` from a reset before
``fully_shard`` to after the shards' initialisation; the step peak is ``max_memory_allocated``
from a reset after the build, over every step; None on the CPU), report (``Program.memory_report()`` as the runtime
records it, max over ranks, when it has one), step_ms_median/min/max, build_s, capture_s,
search_s, weights_write_s, weights_reused, loss_first, loss_last, losses, status, wall_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # appended: an installed autoshard (or the GPU shim) stays first

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.baselines.common import (  # noqa: E402
    SEED,
    RunSpec,
    make_batches,
    measure,
    peak_memory_bytes,
    policy_loss,
    reset_memory,
    synchronize,
)
from benchmarks.hf_zoo import SPECS as HF_SPECS  # noqa: E402
from benchmarks.hf_zoo import is_hf_spec  # noqa: E402

GIB = 2**30
WEIGHTS = ("meta", "safetensors")
BASELINES = ("fsdp2", "fsdp2-noreshard", "fsdp2-noreshard-compiled")
RESULTS_FILE = "materialize.jsonl"
STAMP_FILE = "autoshard_bench.json"  # in --weights-dir: what was written there, so a later run can reuse it
MAX_SHARD_BYTES = 2 * GIB  # files of the written checkpoint (HF's own are 2-10 GB)


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring); exits 2 with one line on a bad value."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help=f"reference spec (llama:7b) or a Hugging Face spec ({', '.join(HF_SPECS)})")
    p.add_argument("--cluster", required=True, help="cluster preset PRESET:NODESxDEVICES, e.g. h100-sxm:1x2; its "
                                                    "world size must be torchrun's")
    p.add_argument("--weights", choices=WEIGHTS, default="meta",
                   help="meta: initialise on shards; safetensors: write a sharded checkpoint, then load it")
    p.add_argument("--baseline", choices=BASELINES, help="run the FSDP2 baseline (meta build) instead of autoshard")
    p.add_argument("--steps", type=int, default=20, help="training steps, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the step-time summary")
    p.add_argument("--seq", type=int, default=1024, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step over all ranks)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--lr", type=float, default=1e-5,
                   help="AdamW learning rate (at 1e-4, run.py's default, llama:7b diverged on 2 GPUs: loss 12.8 -> "
                        "980 by step 5, FSDP2 alike)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="BuildOptions.compile (auto: CUDA and a plan without ZeRO-3)")
    p.add_argument("--weights-dir", type=Path, help="where --weights safetensors writes (default: "
                                                    "/tmp/autoshard_materialize/<model>)")
    p.add_argument("--out", type=Path, required=True, help=f"folder; rank 0 appends a line to {RESULTS_FILE}")
    args = p.parse_args(argv)
    problem = _invalid(args)
    if problem:
        p.error(problem)
    if args.weights_dir is None:
        args.weights_dir = Path("/tmp/autoshard_materialize") / args.model.replace(":", "_")
    return args


def _invalid(args: argparse.Namespace) -> str | None:
    """What is wrong with ``args`` (one line), or ``None``."""
    for name in ("steps", "seq", "batch"):
        if getattr(args, name) < 1:
            return f"--{name} {getattr(args, name)}: must be a positive integer"
    if not 0 <= args.warmup < args.steps:
        return f"--warmup {args.warmup}: must be in [0, --steps={args.steps}) so some steps are timed"
    if args.seq < 4:
        return f"--seq {args.seq}: capture fits two sequence lengths, seq/2 and seq; use --seq 4 or more"
    if args.baseline and args.weights != "meta":
        return f"--baseline {args.baseline} with --weights {args.weights}: the FSDP2 baseline initialises on shards " \
               "(meta) only; drop --weights or --baseline"
    model_problem = _invalid_model(args.model)
    if model_problem:
        return model_problem
    try:
        from autoshard.cluster import Cluster

        Cluster.load(args.cluster)
    except Exception as err:  # noqa: BLE001 - any parse failure is a bad argument
        return f"--cluster {args.cluster!r}: {err}"
    return None


def _invalid_model(spec: str) -> str | None:
    if is_hf_spec(spec):
        return None if spec in HF_SPECS else f"--model {spec!r}: Hugging Face specs are {list(HF_SPECS)}"
    try:
        from autoshard.models import config_for

        config_for(spec)
    except Exception as err:  # noqa: BLE001
        return f"--model {spec!r}: {err}"
    return None


# --------------------------------------------------------------------------- progress and process group


class Progress:
    """Rank 0's progress lines, ``[materialize   12.3s] what``, flushed at once."""

    def __init__(self, rank: int):
        self.rank, self.start = rank, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        if self.rank == 0:
            print(f"[materialize {self.elapsed():7.1f}s] {message}", flush=True)


def _init_distributed(device: str) -> bool:
    """Join torchrun's process group (a world of one without torchrun); True when this call created it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(minutes=10))
    return True


def _rank_device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _max_over_ranks(value: float | None, device: torch.device) -> float | None:
    if value is None:
        return None
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


# --------------------------------------------------------------------------- models, capture, plan


def build_meta_model(spec: str, dtype: torch.dtype) -> torch.nn.Module:
    """The policy ``spec`` on the meta device in ``dtype`` (a reference model or ``hf_zoo``'s)."""
    if is_hf_spec(spec):
        from benchmarks.hf_zoo import build_hf_policy

        return build_hf_policy(spec, device="meta", dtype=dtype)
    from autoshard.models import build

    return build(spec, device="meta", dtype=dtype)


def capture_graph(spec: str, seq: int, dtype: torch.dtype):
    """Capture ``spec`` on meta at sequence lengths (seq/2, seq), as ``benchmarks/run.py`` does."""
    from autoshard.passes.capture import capture

    return capture(build_meta_model(spec, dtype), name=spec, seq_lens=(max(2, seq // 2), seq))


def search_plan(graph, cluster, spec: RunSpec, world: int):
    """Rank 0 searches the best plan under the benchmark pins; every rank gets it."""
    from benchmarks.baselines.plans import broadcast_plans, search_plans

    found: Any = None
    if dist.get_rank() == 0:
        try:
            found = search_plans(graph, cluster, spec, "best", world=world)
        except Exception as err:  # noqa: BLE001 - every rank must learn that the search failed
            from autoshard.errors import AutoshardError

            found = err if isinstance(err, AutoshardError) else AutoshardError(f"{type(err).__name__}: {err}")
    return broadcast_plans(found)[0].plan


def plan_fields(plan) -> dict[str, Any]:
    """Mesh, layer count per state and layer-order runs of one state (``·TP`` marks Megatron TP)."""
    from benchmarks.baselines.report import plan_summary

    states: dict[str, int] = {}
    runs: list[dict[str, Any]] = []
    for layer in plan.layers:
        state = layer.state + ("·TP" if layer.tp == "megatron" else "")
        states[state] = states.get(state, 0) + 1
        if runs and runs[-1]["state"] == state:
            runs[-1].update(last=layer.layer, count=runs[-1]["count"] + 1)
        else:
            runs.append({"state": state, "first": layer.layer, "last": layer.layer, "count": 1})
    mesh = {axis: getattr(plan.mesh, axis) for axis in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")}
    return {"plan": plan_summary(plan), "mesh": mesh, "states": states, "state_runs": runs,
            "micro_batches": plan.schedule.num_micro_batches, "micro_batch": plan.schedule.micro_batch}


def prediction_fields(plan, graph=None, cluster=None, spec: RunSpec | None = None) -> dict[str, Any]:
    """Predicted peak, build peak (GiB) and step (ms): the plan's own, or ``predict`` when a graph is given."""
    predictions = plan.predictions
    if graph is not None:
        from autoshard.search.cost_model import predict
        from benchmarks.baselines.autoshard_trainer import train_spec

        predictions = predict(graph, plan, cluster, train_spec(spec, micro_batch=plan.schedule.micro_batch))
    build_peak = getattr(predictions, "build_peak_bytes", 0) or None
    return {"predicted_peak_gib": predictions.peak_memory_bytes / GIB,
            "predicted_build_peak_gib": build_peak / GIB if build_peak else None,
            "predicted_step_ms": predictions.step_time_s * 1e3}


# --------------------------------------------------------------------------- safetensors weights


def write_weights(model: torch.nn.Module, spec: str, directory: Path, seed: int, device: torch.device) -> bool:
    """Rank 0: random weights of the meta ``model`` as a sharded safetensors directory (module docstring, step 3).

    Returns False when ``directory`` already holds this model's weights for ``seed`` (its stamp
    file matches) and nothing was written.
    """
    stamp = {"model": spec, "seed": seed, "dtype": "bfloat16",
             "values": "torch.Generator normal per init_rule, one parameter at a time"}
    stamp_path = directory / STAMP_FILE
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return False
    from autoshard.init import Constant, Normal, Uniform
    from autoshard.runtime._safetensors_source import write_sharded

    stamp_path.unlink(missing_ok=True)  # a run killed while writing leaves no stamp behind
    generator = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        rule = model.init_rule(name)
        value = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
        if isinstance(rule, Constant):
            value.fill_(rule.value)
        elif isinstance(rule, Uniform):
            value.uniform_(rule.low, rule.high, generator=generator)
        else:
            assert isinstance(rule, Normal), rule
            value.normal_(rule.mean, rule.std, generator=generator)
        state[name] = value.cpu()
        del value
    write_sharded(state, directory, max_shard_bytes=MAX_SHARD_BYTES)
    stamp_path.write_text(json.dumps(stamp) + "\n")
    return True


def prepare_weights(args: argparse.Namespace, model, device: torch.device, progress: Progress) -> tuple[Any, dict]:
    """``build_program``'s ``weights`` for ``--weights`` and the row fields it adds (time to write, reused)."""
    if args.weights == "meta":
        return None, {"weights_write_s": None, "weights_reused": None}
    start = time.perf_counter()
    written = [False]
    if dist.get_rank() == 0:
        progress(f"writing {args.model} weights (bf16) to {args.weights_dir}")
        written[0] = write_weights(model, args.model, args.weights_dir, SEED, device)
    dist.broadcast_object_list(written, src=0)  # also the barrier: every rank waits for the files
    seconds = time.perf_counter() - start
    progress(f"weights {'written' if written[0] else 'reused'} in {seconds:.1f}s")
    return str(args.weights_dir), {"weights_write_s": seconds, "weights_reused": not written[0]}


# --------------------------------------------------------------------------- autoshard and FSDP2 runs


@dataclass
class Built:
    """A built trainer: ``step(global_tokens) -> loss``, the row fields so far, the autoshard ``Program``."""

    step: Callable[[torch.Tensor], float]
    fields: dict[str, Any]
    program: Any = None


def build_autoshard(args, spec: RunSpec, device: torch.device, progress: Progress) -> Built:
    """Capture, search, weights, ``build_program`` (module docstring, steps 1-4)."""
    from autoshard.cluster import Cluster
    from autoshard.runtime import BuildOptions, build_program
    from benchmarks.baselines.autoshard_trainer import train_spec

    fields: dict[str, Any] = {}
    cluster = Cluster.load(args.cluster)
    start = time.perf_counter()
    graph = capture_graph(args.model, args.seq, spec.compute_dtype)
    fields["capture_s"] = time.perf_counter() - start
    progress(f"captured {args.model}: {len(graph.layers)} layers in {fields['capture_s']:.1f}s")
    start = time.perf_counter()
    plan = search_plan(graph, cluster, spec, dist.get_world_size())
    fields["search_s"] = time.perf_counter() - start
    fields.update(plan_fields(plan), **prediction_fields(plan))
    progress(f"plan {fields['plan']}: predicted peak {fields['predicted_peak_gib']:.2f} GiB, build peak "
             f"{_gib(fields['predicted_build_peak_gib'])} GiB")
    model = build_meta_model(args.model, torch.float32)
    weights, weight_fields = prepare_weights(args, model, device, progress)
    fields.update(weight_fields)
    progress("build_program")
    reset_memory(device)
    start = time.perf_counter()
    program = build_program(model, graph, plan, train_spec(spec, micro_batch=plan.schedule.micro_batch),
                            optimizer=spec.optimizer, device=str(device), weights=weights,
                            options=BuildOptions(compile=args.compile, track_memory=device.type == "cpu"))
    synchronize(device)
    fields["build_s"] = _max_over_ranks(time.perf_counter() - start, device)
    # build_program resets the CUDA peak when its build ends: its own report holds the build's peak
    fields["build_peak_gib"] = _gib_or_none(_max_over_ranks(program.memory_report().build_peak_bytes, device))

    def step(tokens: torch.Tensor) -> float:
        return program.step(program.local_batch(tokens), policy_loss).loss

    return Built(step, fields, program)


def build_fsdp2(args, spec: RunSpec, device: torch.device, progress: Progress) -> Built:
    """The FSDP2 baseline from a meta model (``baselines/fsdp2.py``, "Meta build"): (step, row fields)."""
    from autoshard.cluster import Cluster
    from autoshard.plan import Mesh
    from benchmarks.baselines.autoshard_trainer import uniform_plan
    from benchmarks.baselines.fsdp2 import FSDP2Options, FSDP2Trainer

    fields: dict[str, Any] = {"capture_s": None, "search_s": None, "weights_write_s": None, "weights_reused": None}
    reshard = args.baseline == "fsdp2"
    graph = capture_graph(args.model, args.seq, spec.compute_dtype)  # for the nearest plan's prediction
    world = dist.get_world_size()
    nearest = uniform_plan(graph, Mesh(dp_shard=world), state="zero3" if reshard else "zero2",
                           global_batch=spec.global_batch, seq_len=spec.seq_len, precision=spec.precision)
    fields.update(plan_fields(nearest), **prediction_fields(nearest, graph, Cluster.load(args.cluster), spec))
    fields["plan"] = "≈ " + fields["plan"]
    options = FSDP2Options(reshard_after_forward=reshard, compile=args.baseline.endswith("-compiled"))
    model = build_meta_model(args.model, torch.float32)
    progress(f"{args.baseline}: fully_shard on meta, to_empty, init")
    reset_memory(device)
    start = time.perf_counter()
    trainer = FSDP2Trainer(spec, device, options, name=args.baseline, meta_model=model, seed=SEED)
    synchronize(device)
    fields["build_s"] = _max_over_ranks(time.perf_counter() - start, device)
    fields["build_peak_gib"] = _gib_or_none(peak_memory_bytes(device))
    return Built(trainer.step, fields)


def train(step, args, spec: RunSpec, vocab: int, device: torch.device, progress: Progress) -> dict[str, Any]:
    """``--steps`` steps on seeded random tokens; losses, step-time summary and step peak."""
    batches = make_batches(vocab, spec, args.steps)
    reset_memory(device)
    progress(f"training {args.steps} steps ({args.warmup} warm-up)")
    done = [0]

    def logged(tokens: torch.Tensor) -> float:
        loss = step(tokens)  # a float: the step has finished on this rank
        done[0] += 1
        progress(f"step {done[0]}: loss {loss:.4f}")
        return loss

    result = measure(logged, batches, args.warmup, device)
    times_ms = [t * 1e3 for t in result.step_times_s]
    return {"losses": list(result.losses), "loss_first": result.losses[0], "loss_last": result.losses[-1],
            "step_ms_median": statistics.median(times_ms), "step_ms_min": min(times_ms),
            "step_ms_max": max(times_ms), "step_peak_gib": _gib_or_none(result.peak_memory_bytes)}


def memory_report_fields(program: Any, device: torch.device) -> dict[str, Any]:
    """``Program.memory_report()`` (bytes → GiB, max over ranks) when there is a program that has one."""
    report = getattr(program, "memory_report", None)
    if report is None:
        return {}
    out = {}
    for key, value in dataclasses.asdict(report()).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = _max_over_ranks(value, device)
            out[key.replace("_bytes", "_gib")] = value / GIB if key.endswith("_bytes") else value
    return {"report": out}


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One run (module docstring); every rank returns the row, rank 0 writes it."""
    from autoshard.runtime.optimizer import OptimizerConfig

    progress = Progress(dist.get_rank())
    device = _rank_device(args.device)
    spec = RunSpec(model=args.model, global_batch=args.batch, seq_len=args.seq, precision=args.precision,
                   optimizer=OptimizerConfig(name="adamw", lr=args.lr), device=args.device)
    row = _meta(args)
    try:
        _check_world(args)
        build = build_fsdp2 if args.baseline else build_autoshard
        built = build(args, spec, device, progress)
        row.update(built.fields)
        progress(f"built in {row['build_s']:.1f}s, build peak {_gib(row['build_peak_gib'])} GiB")
        row.update(train(built.step, args, spec, _vocab(args.model), device, progress))
        row.update(memory_report_fields(built.program, device))
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - the row records the failure; the driver goes on
        traceback.print_exc()
        row["status"] = f"failed: {type(err).__name__}: {' '.join(str(err).split())[:400]}"
    row["wall_s"] = progress.elapsed()
    progress(f"{row['status']}: step median {_fmt(row.get('step_ms_median'))} ms, step peak "
             f"{_gib(row.get('step_peak_gib'))} GiB")
    return row


def _check_world(args: argparse.Namespace) -> None:
    from autoshard.cluster import Cluster

    cluster = Cluster.load(args.cluster)
    if cluster.world_size != dist.get_world_size():
        raise ValueError(f"--cluster {args.cluster} has {cluster.world_size} devices but torchrun started "
                         f"{dist.get_world_size()} processes; use --nproc-per-node {cluster.world_size}")


def _vocab(spec: str) -> int:
    if is_hf_spec(spec):
        from benchmarks.hf_zoo import hf_config

        return hf_config(spec).vocab_size
    from autoshard.models import config_for

    return config_for(spec).vocab_size


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    """The fields that say what ran where."""
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"model": args.model, "config": args.baseline or "autoshard", "weights": args.weights,
            "cluster": args.cluster, "world_size": dist.get_world_size(), "card": card, "torch": torch.__version__,
            "transformers": hf_version,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seq": args.seq, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "precision": args.precision, "lr": args.lr, "compile": args.compile, "device": args.device}


def _gib_or_none(value: int | None) -> float | None:
    return None if value is None else value / GIB


def _gib(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def write_row(out: Path, row: dict[str, Any]) -> Path:
    """Append ``row`` as one JSON line to ``out/materialize.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Parse, run once, write the row on rank 0; 0 when the run is ok, 1 when it failed."""
    args = parse_args(argv)
    owns_group = _init_distributed(args.device)
    try:
        row = run(args)
        if dist.get_rank() == 0:
            print(f"[materialize] row appended to {write_row(args.out, row)}", flush=True)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
