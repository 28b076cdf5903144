"""Benchmark autoshard's plans against hand-written FSDP2 / Megatron-Core / DeepSpeed baselines.

Under torchrun, one process per GPU (docs/benchmarks.md)::

    torchrun --standalone --nproc-per-node 8 benchmarks/run.py --model llama:350m --batch 16 --seq 2048 \\
        --configs autoshard,fsdp2,fsdp2-noreshard,megatron-tp,deepspeed-z2,deepspeed-z3 --out results/bench

On the CPU (gloo, tiny sizes; what CI runs): ``--device cpu --model gpt:tiny --batch 4 --seq 16``.

``--model`` is a reference spec (``autoshard models``) or a Hugging Face model of the zoo
``benchmarks/hf_zoo.py`` (``hf-llama:7b``, ``hf-qwen2:1.5b``, ``hf-gpt2:350m``, ``hf-gemma:2b``,
``hf-phi:2.7b``, ``hf-mixtral:1.5b``, ...; ``FAMILY:tiny`` for the CPU), random weights,
nothing read from a hub. Every config runs it as it runs a reference model: captured on the meta
device in the compute dtype, each trainer built from the seeded fp32 weights
(``common.reference_model``). The zoo is planned data-parallel only (``hf_zoo.mesh_pins``: tp = 1
in the search and no forced TP variant; the zoo's docstring says why). Without ``transformers``
every row of an ``hf-*`` run is ``skipped: transformers not installed`` (the files are still
written).

Steps, in one process group:

1. ``Cluster.detect()`` describes the machine; ``--calibration FILE`` (written by
   ``autoshard cluster calibrate``) gives a calibrated copy, which then drives the search;
2. capture the model (meta device, compute dtype) and search: ``--plans best``
   (the ``autoshard`` config) or ``--plans forced`` (best + forced alternatives,
   ``baselines/plans.py``); rank 0 searches and broadcasts;
3. each config in turn from the same seeded weights and batches: build,
   ``--steps`` steps of which ``--warmup`` untimed, measure (``baselines/common.py``:
   median step time of the slowest rank, tokens/s, MFU, CUDA peak memory reset
   between configs), free;
4. rank 0 writes ``OUT/results.json`` and ``OUT/results.md`` after every config
   (a crash keeps what was measured).

``--list-plans`` stops after step 2: rank 0 prints the autoshard plans with their
predictions, then each requested baseline's nearest autoshard plan (below) with its
predicted step and peak memory, and writes ``OUT/plans.json`` (``{"meta", "plans":
[{"config", "plan", "predicted", "predicted_calibrated", "plan_json"}], "baselines":
[...]}``); nothing is trained, no baseline is built. With ``--cluster h100-sxm:1x4`` a CPU
plans and predicts for that cluster at its world size (a memory check before a GPU run)::

    python benchmarks/run.py --device cpu --list-plans --cluster h100-sxm:1x4 --model gpt:1.3b \
        --batch 16 --seq 1024 --configs autoshard,fsdp2,megatron-tp,deepspeed-z3 --out /tmp/plans

``--cluster PRESET:1xN`` on a measured run plans and predicts for that cluster instead of this
machine (its world size must be torchrun's): ``h100-sxm:1x2`` gives the plan for 80 GB cards also
on H200s (141 GB). MFU then uses the preset's peak FLOP/s (H100 and H200: the same bf16 peak).

``--graph-cache DIR`` keeps the captured graph as a pickle in DIR (one file per model, sequence
length, dtype and overrides) and reuses it: one process per config captures a model once per
session (``hf-llama:7b``: 13-17 s, every block exported).

``--variants tp4,tp4-sp`` measures the best plan plus only the named forced variants
(``baselines/plans.py``), e.g. autoshard's TP plan next to the Megatron-Core rows.

Every row keeps its per-step losses; ``report.loss_agreement`` pairs autoshard's TP plan
with ``megatron-tp`` / ``megatron-tp-sp`` and ZeRO-3 with ZeRO-3 (``deepspeed-z3`` /
``fsdp2``) and states the max relative loss difference against 1e-2 in both files.

Predictions next to measurements: an autoshard plan's own predicted step time and
peak memory (``search.cost_model.predict`` on the detected cluster, and on the
calibrated one when given; error = (predicted − measured) / measured). A
baseline row shows the prediction of its nearest autoshard plan (FSDP2 and
DeepSpeed ZeRO-3 → ``zero3`` on every layer; FSDP2 without resharding and
ZeRO-2 → ``zero2``; Megatron TP → ``replicate`` with Megatron TP over the whole
world), so the cost model is judged on the baselines too.

A config whose package or hardware is missing (Megatron without CUDA,
DeepSpeed not installed) is reported as ``skipped``; one that raises is
reported as ``failed`` with the error, and the run goes on (``--stop-on-error``
re-raises instead).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # appended: an installed autoshard (or the GPU shim) stays first

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from autoshard.cluster import Cluster  # noqa: E402
from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.plan import Mesh, Plan  # noqa: E402
from autoshard.runtime.optimizer import OptimizerConfig  # noqa: E402
from benchmarks.baselines import report  # noqa: E402
from benchmarks.baselines.autoshard_trainer import AutoshardTrainer, train_spec, uniform_plan  # noqa: E402
from benchmarks.baselines.common import (  # noqa: E402
    BaselineUnavailable,
    RunSpec,
    make_batches,
    measure,
    model_flops_per_step,
    prepare_reference,
    rank_device,
    reset_after_build,
    reset_memory,
    synchronize,
)
from benchmarks.baselines.plans import MODES, broadcast_plans, search_plans  # noqa: E402
from benchmarks.hf_zoo import is_hf_spec  # noqa: E402

log = logging.getLogger("benchmarks.run")

BASELINES = ("fsdp2", "fsdp2-noreshard", "fsdp2-compiled", "fsdp2-noreshard-compiled", "megatron-tp", "megatron-tp-sp",
             "deepspeed-z2", "deepspeed-z3")
CONFIGS = ("autoshard", *BASELINES)
# Nearest autoshard plan of each baseline: (state, Megatron TP over the world).
EQUIVALENT = {"fsdp2": ("zero3", False), "fsdp2-noreshard": ("zero2", False), "fsdp2-compiled": ("zero3", False),
              "fsdp2-noreshard-compiled": ("zero2", False), "megatron-tp": ("replicate", True),
              "megatron-tp-sp": ("replicate", True), "deepspeed-z2": ("zero2", False),
              "deepspeed-z3": ("zero3", False)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:350m",
                   help="reference model spec (see `autoshard models`) or a Hugging Face spec such as hf-qwen2:1.5b "
                        "(benchmarks/hf_zoo.py)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step over all ranks)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per rank per step (baselines)")
    p.add_argument("--configs", default="autoshard,fsdp2,fsdp2-noreshard,megatron-tp,deepspeed-z2,deepspeed-z3",
                   help=f"comma-separated, from {','.join(CONFIGS)}")
    p.add_argument("--plans", choices=MODES, default="best", help="autoshard plans: the search's best, or best + forced")
    p.add_argument("--max-plans", type=int, default=12, help="cap on autoshard plans with --plans forced")
    p.add_argument("--variants", help="comma-separated forced variants measured after the best plan, e.g. tp4,tp4-sp "
                                      "(baselines/plans.py; implies --plans forced)")
    p.add_argument("--cluster", help="plan and predict for this cluster (e.g. h100-sxm:1x4) instead of this machine: "
                                     "with --list-plans at its world size, in a measured run at torchrun's")
    p.add_argument("--graph-cache", type=Path, help="folder of captured graphs reused across processes")
    p.add_argument("--steps", type=int, default=12, help="steps per config, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per config")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--attn", choices=("sdpa", "math"), default=None,
                   help="attention path of the reference model for every config (default: the family's; GPT's is "
                        "the explicit math path, sdpa uses fused kernels as Megatron-Core does)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="every config's optimizer; sgd (no momentum) keeps bf16 rounding differences from being "
                        "amplified into lr-sized steps, as Adam's first sign-like steps do (loss-agreement runs)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calibration", type=Path, help="calibration JSON (`autoshard cluster calibrate`)")
    p.add_argument("--out", type=Path, required=True, help="output folder for results.json and results.md")
    p.add_argument("--stop-on-error", action="store_true", help="re-raise a failing config instead of going on")
    p.add_argument("--profile", action="store_true",
                   help="after each config's timed steps, one more step under torch.profiler; the row gets a "
                        "summary (GPU busy/idle, per-stream NCCL and compute time, top kernels; this rank's "
                        "view). Every config measured after the first profiled one runs slower (measured on "
                        "H100s): compare only the first config's timing, or profile one config per process")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="after each config's timed steps, one more step under the CUDA allocator's history "
                        "(torch.cuda.memory._record_memory_history); the row gets memory_at_peak: the bytes "
                        "live before the step, the step's peak and what was allocated in the step and still "
                        "live at that peak, grouped by the allocating Python line (this rank; CUDA only)")
    p.add_argument("--list-plans", action="store_true",
                   help="search only: print the autoshard plans and predictions, write OUT/plans.json, train nothing")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs {unknown}: allowed {list(CONFIGS)}")
    if args.max_plans < 1:
        p.error(f"--max-plans {args.max_plans}: allowed >= 1")
    if args.variants is not None:
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        args.plans = "forced"
    if args.attn is not None and is_hf_spec(args.model):
        p.error(f"--attn with {args.model}: the Hugging Face policies run SDPA (benchmarks/hf_zoo.py)")
    return args


def _init_distributed(device: str) -> bool:
    """Join torchrun's process group unless one exists; True when this call created it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:  # plain `python benchmarks/run.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    return True


def _capture(spec: RunSpec, cache_dir: Path | None = None, compiled: bool = False):
    """The captured graph of ``spec``'s model; cached per (model, seq, dtype) for repeated ``main`` calls,
    and in ``cache_dir`` (``--graph-cache``) across processes. ``compiled`` (plans for a GPU cluster, where
    the runtime compiles): the graph also carries the compiled step's block-activation scale
    (``passes.compiled_saved.with_compiled_saved_scale``, traced on meta: seconds per model)."""
    key = (spec.model, spec.seq_len, spec.compute_dtype, tuple(sorted(spec.model_overrides.items())), compiled)
    if cache_dir is None:
        return _capture_cached(*key)
    return _capture_file(cache_dir, key)


def _capture_file(cache_dir: Path, key: tuple):
    """Load the pickled graph of ``key`` from ``cache_dir``, else capture it and (rank 0) write it atomically."""
    import pickle

    model, seq_len, dtype, overrides, compiled = key
    extra = "".join(f"_{k}-{v}" for k, v in overrides) + ("_compiled" if compiled else "")
    path = cache_dir / f"{model.replace(':', '_')}_s{seq_len}_{str(dtype).rsplit('.', 1)[-1]}{extra}.pkl"
    if path.exists():
        try:
            return pickle.loads(path.read_bytes())
        except Exception as err:  # noqa: BLE001 - a stale or torn file: capture again
            log.warning("graph cache %s unreadable (%s): capturing", path, err)
    graph = _capture_cached(*key)
    if not dist.is_initialized() or dist.get_rank() == 0:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps(graph))
        tmp.replace(path)
    return graph


@functools.lru_cache(maxsize=4)
def _capture_cached(model: str, seq_len: int, dtype: torch.dtype, overrides: tuple = (), compiled: bool = False):
    from autoshard.passes.capture import capture

    seq_lens = (max(2, seq_len // 2), seq_len)
    if is_hf_spec(model):  # a Hugging Face trunk on meta, buffers on the CPU (benchmarks/hf_zoo.py)
        from benchmarks.baselines.common import hf_overrides
        from benchmarks.hf_zoo import build_hf_policy

        meta = build_hf_policy(model, device="meta", dtype=dtype, **hf_overrides(dict(overrides)))
    else:
        from autoshard.models import build

        meta = build(model, device="meta", dtype=dtype, **dict(overrides))
    graph = capture(meta, name=model, seq_lens=seq_lens)
    from autoshard.passes.compiled_saved import with_compiled_saved_scale

    return with_compiled_saved_scale(graph, meta, seq_len) if compiled else graph


def hf_available() -> bool:
    """Whether ``transformers`` imports here (``hf-*`` models need it)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _baseline_factory(name: str) -> Callable[..., Any]:
    """``factory(spec, device)`` for a baseline config (imports its package lazily)."""
    if name.startswith("fsdp2"):
        from benchmarks.baselines.fsdp2 import FSDP2Trainer

        options = fsdp2_options(name)
        return lambda spec, device: FSDP2Trainer(spec, device, options, name=name)
    if name.startswith("megatron"):
        from benchmarks.baselines.megatron import MegatronOptions, MegatronTPTrainer

        options = MegatronOptions(sequence_parallel=name.endswith("-sp"))
        return lambda spec, device: MegatronTPTrainer(spec, device, options, name=name)
    from benchmarks.baselines.deepspeed_zero import DeepSpeedTrainer

    return lambda spec, device: DeepSpeedTrainer(spec, device, stage=int(name[-1]), name=name)


def fsdp2_options(name: str):
    """``FSDP2Options`` of an ``fsdp2*`` config: ``-noreshard`` keeps gathered weights to backward,
    ``-compiled`` compiles each block (torchtitan's per-block ``torch.compile``)."""
    from benchmarks.baselines.fsdp2 import FSDP2Options

    return FSDP2Options(reshard_after_forward="noreshard" not in name, compile=name.endswith("-compiled"))


def _run_one(name: str, build: Callable[[], Any], batches, warmup: int, device, stop_on_error: bool,
             profile: bool = False, memory_snapshot: bool = False) -> dict:
    """Build and measure one config; a row with ``status`` ok / skipped / failed."""
    reset_memory(device)
    trainer = None
    start = time.perf_counter()
    try:
        trainer = build()
        built = time.perf_counter()
        build_peak = reset_after_build(device)  # the harness's fp32 reference model is not the step's
        result = measure(trainer.step, batches, warmup, device)
        # build_s / wall_s: this rank's set-up and whole-config times, to budget later runs
        row = {"config": name, "status": "ok", "losses": list(result.losses),
               "step_times_s": list(result.step_times_s), "median_step_s": result.median_step_s,
               "peak_memory_bytes": result.peak_memory_bytes, "peak_by_step": list(result.peak_by_step),
               "build_peak_bytes": build_peak, "build_s": built - start}
        fallbacks = ((getattr(getattr(trainer, "program", None), "compile_options", None) or {})
                     .get("fallbacks"))
        if fallbacks:  # graphs compiled without inductor's overlap passes (runtime/inductor_fallback.py)
            row["compile_fallbacks"] = list(fallbacks)
        if profile:
            row["profile"] = profile_step(trainer.step, batches[-1], device)
        if memory_snapshot and device.type == "cuda":
            row["memory_at_peak"] = memory_snapshot_step(trainer.step, batches[-1], device)
        row["wall_s"] = time.perf_counter() - start
        return row
    except BaselineUnavailable as err:
        return {"config": name, "status": f"skipped: {err}"}
    except Exception as err:  # noqa: BLE001 - one failing config must not lose the others' numbers
        if stop_on_error:
            raise
        log.error("config %s failed:\n%s", name, traceback.format_exc())
        return {"config": name, "status": f"failed: {type(err).__name__}: {err}"}
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        reset_memory(device)


def profile_step(step: Callable[[torch.Tensor], Any], tokens: torch.Tensor, device, top: int = 12) -> dict:
    """One more ``step(tokens)`` under ``torch.profiler``; this rank's summary (``--profile``).

    ``span_ms`` first to last kernel, ``gpu_busy_ms``/``gpu_idle_ms`` (union of kernel intervals
    and the rest of the span), per-stream NCCL and compute kernel ms (``overlap_bench._streams``),
    ``host_ms`` the wall time of the step on the host, ``top_kernels`` by total ms.
    """
    import tempfile

    from benchmarks.overlap_bench import _kernels, _streams, interval_union

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step(tokens)
        host = time.perf_counter() - t0
        synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    kernels = _kernels(events)
    out: dict[str, Any] = {"host_ms": host * 1e3, "kernels": len(kernels)}
    if not kernels:
        return out
    busy = interval_union([(k["start"], k["end"]) for k in kernels])
    span = busy[-1][1] - busy[0][0]
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        entry = by_name.setdefault(k["name"][:120], [0.0, 0])
        entry[0] += (k["end"] - k["start"]) * 1e-3
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    streams = _streams(kernels)
    out.update(span_ms=span * 1e-3, gpu_busy_ms=sum(b - a for a, b in busy) * 1e-3,
               gpu_idle_ms=streams["gpu_idle_s"] * 1e3, streams=streams["streams"],
               top_kernels=[{"name": n, "ms": ms, "count": c} for n, (ms, c) in ranked])
    return out


def memory_snapshot_step(step: Callable[[torch.Tensor], Any], tokens: torch.Tensor, device, top: int = 20) -> dict:
    """One more ``step(tokens)`` under the CUDA allocator's history; ``peak_summary`` of it (``--memory-snapshot``)."""
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step(tokens)
        synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return peak_summary(snapshot["device_traces"][index], before, top)


def peak_summary(trace: list[dict], before: int, top: int = 20) -> dict:
    """Replay one device's allocator trace from ``before`` live bytes: the peak, and what the step
    allocated that was live at it, grouped by the allocating line.

    ``trace``: the events of ``torch.cuda.memory._snapshot()["device_traces"][i]`` (``action``
    alloc / free_completed, ``addr``, ``size``, ``frames`` innermost first). A block freed in the
    step but allocated before it only lowers the running total. The group of a block is the first
    frame outside ``torch/`` (the model, runtime or benchmark line that caused it), else the
    innermost frame.
    """
    current = peak = before
    peak_at = -1  # index of the allocation that reached the peak
    for i, event in enumerate(trace):  # first pass: the running total
        if event.get("action") == "alloc":
            current += int(event["size"])
            if current > peak:
                peak, peak_at = current, i
        elif event.get("action") == "free_completed":
            current -= int(event["size"])
    live: dict[int, dict] = {}
    for event in trace[:peak_at + 1]:  # second pass: what the step allocated and had not freed by then
        if event.get("action") == "alloc":
            live[event["addr"]] = event
        elif event.get("action") == "free_completed":
            live.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in live.values():
        frames = event.get("frames") or []
        frame = next((f for f in frames if "/torch/" not in f.get("filename", "")), frames[0] if frames else None)
        where = f"{'/'.join(frame['filename'].rsplit('/', 2)[-2:])}:{frame['line']} {frame['name']}" if frame else "?"
        entry = groups.setdefault(where, [0, 0])
        entry[0] += int(event["size"])
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"before_step_bytes": before, "peak_bytes": peak, "allocated_in_step_at_peak_bytes": peak - before,
            "top": [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in ranked]}


def _predict(graph, plan: Plan, cluster: Cluster | None, spec: RunSpec) -> dict | None:
    from autoshard.search.cost_model import predict

    if cluster is None:
        return None
    try:
        p = predict(graph, plan, cluster, train_spec(spec, micro_batch=plan.schedule.micro_batch))
    except AutoshardError as err:
        return {"error": str(err)}
    return {"step_time_s": p.step_time_s, "peak_memory_bytes": p.peak_memory_bytes}


def _equivalent_plan(name: str, graph, spec: RunSpec, world: int) -> Plan:
    state, tp = EQUIVALENT[name]
    mesh = Mesh(tp=world) if tp else Mesh(dp_shard=world)
    micro = 1 if tp else spec.num_micro_batches
    return uniform_plan(graph, mesh, state=state, tp=tp, num_micro_batches=micro, global_batch=spec.global_batch,
                        seq_len=spec.seq_len, precision=spec.precision, optimizer=spec.optimizer.name)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring); returns 0."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    owns_group = _init_distributed(args.device)
    try:
        _benchmark(args)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return 0


def _benchmark(args: argparse.Namespace) -> None:
    device = rank_device(args.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    # Cluster.detect reads torchrun's variables; a group made another way (tests) is one host.
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    spec = RunSpec(model=args.model, global_batch=args.batch, seq_len=args.seq, num_micro_batches=args.micro_batches,
                   attn_impl=args.attn,
                   precision=args.precision, optimizer=OptimizerConfig(name=args.optimizer, lr=args.lr), device=args.device)
    detected = Cluster.load(args.cluster) if args.cluster else Cluster.detect()
    if args.cluster and not args.list_plans and detected.world_size != world:
        raise AutoshardError(f"--cluster {args.cluster} has {detected.world_size} devices but torchrun started {world} "
                             f"processes; use --nproc-per-node {detected.world_size}")
    calibrated = detected.with_calibration(args.calibration) if args.calibration else None
    if is_hf_spec(spec.model) and not hf_available():
        _skip_all(args, spec, detected, world, rank, "skipped: transformers not installed")
        return
    graph = _capture(spec, args.graph_cache, compiled=not detected.runs_on_cpu)
    if args.list_plans:
        world = detected.world_size if args.cluster else world
        _list_plans(graph, _plans(graph, calibrated or detected, spec, args, world, rank), detected, calibrated,
                    spec, args, world, rank)
        return
    plans = _plans(graph, calibrated or detected, spec, args, world, rank) if "autoshard" in args.configs else []
    batches = make_batches(graph.vocab, spec, args.steps)
    prepare_reference(spec)  # the seeded weights every config copies; before the first peak-memory reset
    meta = report.run_meta(args, spec, detected, world, model_flops_per_step(graph, spec))
    rows: list[dict] = []

    def record(row: dict, plan: Plan) -> None:
        row["plan"] = plan_label(plan)
        row["tp"], row["sp"] = plan.mesh.tp, any(s.sp for s in plan.layers)  # loss pairs (report.loss_agreement)
        row["predicted"] = _predict(graph, plan, detected, spec)
        row["predicted_calibrated"] = _predict(graph, plan, calibrated, spec)
        row["plan_dict"] = plan.to_dict()  # the whole plan, so a later cost model can re-predict the row
        rows.append(report.finish_row(row, meta))
        if rank == 0:
            report.write(args.out, meta, rows)

    for named in plans:
        build = lambda plan=named.plan, name=named.name: AutoshardTrainer(spec, device, graph, plan, detected, name=name)  # noqa: E731
        record(_run_one(named.name, build, batches, args.warmup, device, args.stop_on_error, args.profile,
                        args.memory_snapshot), named.plan)
    for name in (c for c in args.configs if c != "autoshard"):
        build = lambda name=name: _baseline_factory(name)(spec, device)  # noqa: E731
        row = _run_one(name, build, batches, args.warmup, device, args.stop_on_error, args.profile,
                       args.memory_snapshot)
        record(row, _equivalent_plan(name, graph, spec, world))
    if rank == 0:
        print(report.markdown(meta, rows))


def _skip_all(args: argparse.Namespace, spec: RunSpec, cluster: Cluster, world: int, rank: int, status: str) -> None:
    """Write a row with ``status`` for every config (nothing is captured or built)."""
    meta = report.run_meta(args, spec, cluster, world, float("nan"))
    rows = [report.finish_row({"config": name, "status": status}, meta) for name in args.configs]
    if rank == 0:
        report.write(args.out, meta, rows)
        print(report.markdown(meta, rows))


def plan_label(plan: Plan) -> str:
    """``report.plan_summary`` plus what it leaves out: pp and its schedule, SP, recompute, quantized comm.

    E.g. ``dp_shard=2; zero3×12; m=1 mb=2; R(sel)×2 qW8×12``; features are counted
    over layers in ``LayerStrategy.notation`` terms (``R(full)``, ``qG4``, ...).
    """
    text = report.plan_summary(plan)
    extras: list[str] = []
    if plan.mesh.pp > 1:
        v = plan.schedule.virtual_stages
        extras.append(f"pp={plan.mesh.pp} {plan.schedule.name}" + (f" v={v}" if v > 1 else ""))
    counts: dict[str, int] = {}
    for s in plan.layers:
        for part in s.notation.split("·")[1:]:
            if part != "TP":  # already in plan_summary
                counts[part] = counts.get(part, 0) + 1
    extras += [f"{k}×{v}" for k, v in sorted(counts.items())]
    return text + ("; " + " ".join(extras) if extras else "")


def _list_plans(graph, plans, detected: Cluster, calibrated: Cluster | None, spec: RunSpec,
                args: argparse.Namespace, world: int, rank: int) -> None:
    """``--list-plans``: predictions of every plan, printed and written to ``OUT/plans.json`` by rank 0."""
    if rank != 0:
        return
    rows = [{"config": p.name, "plan": plan_label(p.plan), "predicted": _predict(graph, p.plan, detected, spec),
             "predicted_calibrated": _predict(graph, p.plan, calibrated, spec), "plan_json": p.plan.to_json()}
            for p in plans]
    baselines = []  # the baselines' nearest autoshard plans: a memory check before a GPU run
    for name in (c for c in args.configs if c != "autoshard"):
        try:
            plan = _equivalent_plan(name, graph, spec, world)
        except AutoshardError as err:
            baselines.append({"config": name, "plan": "–", "predicted": {"error": str(err)}})
            continue
        baselines.append({"config": name, "plan": "≈ " + plan_label(plan),
                          "predicted": _predict(graph, plan, detected, spec),
                          "predicted_calibrated": _predict(graph, plan, calibrated, spec)})
    meta = {"model": spec.model, "global_batch": spec.global_batch, "seq_len": spec.seq_len, "world_size": world,
            "precision": spec.precision, "cluster": detected.name, "plans": args.plans, "max_plans": args.max_plans}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plans.json").write_text(json.dumps({"meta": meta, "plans": rows, "baselines": baselines}, indent=1)
                                         + "\n")
    print(f"{len(rows)} autoshard plans (then the baselines' nearest plans) for {spec.model}, "
          f"batch {spec.global_batch} x seq {spec.seq_len}, world {world} ({detected.name}):")
    print("| config | plan | pred ms | pred GiB |\n|---|---|---|---|")
    for row in rows + baselines:
        pred = row["predicted"] or {}
        ms = f"{pred['step_time_s'] * 1e3:.1f}" if "step_time_s" in pred else pred.get("error", "–")
        gib = f"{pred['peak_memory_bytes'] / 2**30:.2f}" if "peak_memory_bytes" in pred else "–"
        print(f"| {row['config']} | {row['plan']} | {ms} | {gib} |")


def _plans(graph, cluster: Cluster, spec: RunSpec, args: argparse.Namespace, world: int, rank: int):
    found: Any = None
    if rank == 0:
        try:
            found = search_plans(graph, cluster, spec, args.plans, max_plans=args.max_plans, world=world,
                                 only=args.variants)
        except AutoshardError as err:
            found = err
    return broadcast_plans(found)


if __name__ == "__main__":
    sys.exit(main())
