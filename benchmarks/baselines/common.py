"""What every benchmarked trainer shares: the loss, the data, the optimizer, timing and memory.

Decisions (the same for autoshard and every baseline, so a row of the table
differs from another only by how the step is parallelised):

- **Loss** (``policy_loss``): next-token cross-entropy of the logits plus a
  value-head MSE against a zero target, ``CE(logits[:, :-1], tokens[:, 1:]) +
  mean(values²)``, both means over the micro-batch. It is the loss of the
  runtime numerics tests (``tests/_runtime_cases.py``) and touches both heads,
  as a PPO step does. The Megatron baseline computes the same value with a
  vocab-parallel cross-entropy (``baselines/megatron.py``).
- **Step**: the global batch ``[B, S]`` is cut into equal data-parallel slices
  (rank ``r`` takes ``chunk(dp)[r]``), each slice into ``num_micro_batches``
  micro-batches; each micro-batch's loss is divided by their number and
  backpropagated; gradients are averaged over data-parallel ranks; the global
  gradient norm is clipped to ``max_grad_norm``; one optimizer step. The
  reported loss is the mean over micro-batches and data-parallel ranks (what
  ``Program.step`` reports).
- **Weights**: every trainer starts from ``build(spec, seed=SEED)`` in fp32 (the
  reference initialisation on the run's device kind: ``reference_model``, cached
  per process on the CPU, built on the device on GPUs), so step-1 losses agree
  across configs. A Hugging Face spec (``hf-llama:7b``, ``hf-qwen2:1.5b``, ...: ``benchmarks/hf_zoo.py``)
  is built the same way by ``build_hf_policy``, on the rank's device.
- **Optimizer**: ``OptimizerConfig`` of the runtime; baselines build the
  matching ``torch.optim.AdamW`` (decoupled decay, as the runtime's) or
  ``torch.optim.SGD`` (plain ``p -= lr·g``; weight decay must be 0 there, since
  torch couples it).
- **Timing**: wall time of whole steps, with ``torch.cuda.synchronize`` before
  and after on GPUs; each step's time is the slowest rank's (all-reduce MAX);
  the table reports the median of the measured steps after ``warmup`` steps.
- **Memory**: ``torch.cuda.max_memory_allocated`` (max over ranks) of the
  steps, reset after each config is built (``reset_after_build``): every
  config builds from the fp32 reference model materialised whole on each GPU
  (``reference_model``; 27 GB for a 7B model), which is the harness's, not
  the config's, so the build's peak is recorded apart (``build_peak_bytes``).
  On CPU there is no
  resettable per-config peak, so it is reported as ``None``.
- **MFU**: model FLOPs ``3·Σ_layers forward_flops(B, S)`` from the captured
  graph (the formula ``search.cost_model.predict`` uses) over ``step time ·
  world · peak_flops[precision]`` of the cluster's device.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoshard.errors import AutoshardError
from autoshard.runtime.optimizer import OptimizerConfig

SEED = 0  # init seed of every trainer's model
DATA_SEED = 1  # token stream seed
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class BaselineError(AutoshardError):
    """A benchmark or baseline was asked for something it cannot run (bad config, missing package)."""


class BaselineUnavailable(BaselineError):
    """A baseline's package or hardware is missing here (Megatron without CUDA, DeepSpeed not installed)."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One benchmark step's shape, shared by every trainer.

    model: reference model spec, e.g. ``"llama:350m"``.
    global_batch: sequences per optimizer step over all data-parallel ranks.
    seq_len: tokens per sequence.
    num_micro_batches: micro-batches per rank per step (gradient accumulation).
    precision: ``"bf16"`` (bf16 compute, fp32 master weights and reductions) or ``"fp32"``.
    optimizer: hyper-parameters, the runtime's ``OptimizerConfig``.
    device: ``"cuda"`` or ``"cpu"`` (each rank uses ``cuda:LOCAL_RANK``).
    attn_impl: the reference model's attention path for every config built from it
    (``"sdpa"`` or ``"math"``); ``None`` keeps the family default (GPT: ``"math"``, the
    explicit path whose captured activations match Korthikanti et al.; Llama: ``"sdpa"``).
    Megatron-Core runs its own attention whatever this says.
    num_layers: ``None`` keeps the model's depth; a smaller count builds the same blocks fewer
    times.
    """

    model: str
    global_batch: int
    seq_len: int
    num_micro_batches: int = 1
    precision: str = "bf16"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    device: str = "cuda"
    attn_impl: str | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in DTYPES:
            raise BaselineError(f"RunSpec.precision={self.precision!r}: allowed {tuple(DTYPES)}")
        if self.device not in ("cuda", "cpu"):
            raise BaselineError(f"RunSpec.device={self.device!r}: allowed ('cuda', 'cpu')")
        for name in ("global_batch", "seq_len", "num_micro_batches"):
            if getattr(self, name) < 1:
                raise BaselineError(f"RunSpec.{name}={getattr(self, name)!r}: must be a positive integer")

    @property
    def model_overrides(self) -> dict[str, str]:
        """Config fields passed to ``autoshard.models.build`` / ``capture_reference`` for this run."""
        fields = {"attn_impl": self.attn_impl, "num_layers": self.num_layers}
        return {name: value for name, value in fields.items() if value is not None}

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


class Trainer(Protocol):
    """What ``benchmarks/run.py`` drives: one optimizer step on a global batch."""

    name: str

    def step(self, global_tokens: torch.Tensor) -> float:
        """One optimizer step on ``global_tokens`` [B, S] (every rank passes the same tensor); the reported loss."""

    def close(self) -> None:
        """Release process groups and memory the trainer owns."""


# --------------------------------------------------------------------------- loss, data, weights


def policy_loss(outputs: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy plus value MSE to 0: logits [b, S, V], values [b, S], tokens [b, S] → []."""
    logits, values = outputs
    vocab = logits.shape[-1]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
    return ce + values.float().pow(2).mean()


def make_batches(vocab: int, spec: RunSpec, steps: int, *, seed: int = DATA_SEED) -> list[torch.Tensor]:
    """``steps`` global token batches [B, S] on the CPU, the same on every rank (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (spec.global_batch, spec.seq_len), generator=generator) for _ in range(steps)]


def reference_model(spec: RunSpec, device: torch.device | str) -> nn.Module:
    """The reference policy in fp32 on ``device``, initialised with ``SEED`` (identical on every rank).

    On the CPU, initialised once per process, then cached: ``init_weights`` takes 15-30 s
    for a 1.3B model on one thread (torchrun's default) and a run builds the model once
    per config; each call materialises a fresh module (``to_empty``, ties restored) and
    copies the cached weights into it. On GPUs each call builds and initialises the model
    on ``device`` directly: the counter-based init (``autoshard.init``, 2²²-element chunks
    on a GPU) gives the same values, bit for bit, on every rank and in every process, where
    a CPU cache of a 7B model would cost 27 GB of host memory per rank and two 27 GB copies
    per config. A Hugging Face spec (``hf-qwen2:1.5b``) is built by
    ``hf_zoo.build_hf_policy`` on ``device`` likewise, on the CPU too (only the tiny
    sizes run there).
    """
    if is_hf_spec(spec.model):
        from benchmarks.hf_zoo import build_hf_policy

        return build_hf_policy(spec.model, device=device, dtype=torch.float32, seed=SEED,
                               **hf_overrides(spec.model_overrides))
    from autoshard.models import build

    if torch.device(device).type == "cuda":
        return build(spec.model, device=device, dtype=torch.float32, seed=SEED, **spec.model_overrides)
    model = build(spec.model, device="meta", dtype=torch.float32, **spec.model_overrides).to_empty(device=device)
    model.tie_weights()
    model.load_state_dict(_reference_state(spec.model, "cpu", spec.num_layers))
    return model


def prepare_reference(spec: RunSpec) -> None:
    """Initialise ``reference_model``'s CPU cache now, outside any config's memory peak (nothing on GPUs)."""
    if is_hf_spec(spec.model) or spec.device == "cuda":
        return
    _reference_state(spec.model, "cpu", spec.num_layers)


@functools.lru_cache(maxsize=1)
def _reference_state(model: str, init_device: str, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    from autoshard.models import build

    device = torch.device("cuda", torch.cuda.current_device()) if init_device == "cuda" else torch.device("cpu")
    depth = {} if num_layers is None else {"num_layers": num_layers}
    built = build(model, device=device, dtype=torch.float32, seed=SEED, **depth)
    return {name: value.detach().cpu() for name, value in built.state_dict().items()}


def is_hf_spec(model: str) -> bool:
    """Whether ``model`` names a Hugging Face policy of ``benchmarks/hf_zoo.py`` (``hf-qwen2:1.5b``, ...)."""
    from benchmarks.hf_zoo import is_hf_spec as hf_spec

    return hf_spec(model)


def hf_overrides(overrides: dict[str, object]) -> dict[str, object]:
    """``RunSpec.model_overrides`` as Hugging Face config fields: ``num_layers`` → ``num_hidden_layers``.

    ``attn_impl`` other than SDPA is refused: the policy runs HF's SDPA attention.
    """
    out = dict(overrides)
    if out.pop("attn_impl", "sdpa") != "sdpa":
        raise BaselineError(f"attn_impl={overrides['attn_impl']!r}: the Hugging Face policies run 'sdpa' only")
    if "num_layers" in out:
        out["num_hidden_layers"] = out.pop("num_layers")
    return out


def local_rows(global_tokens: torch.Tensor, dp_size: int, dp_rank: int) -> torch.Tensor:
    """This data-parallel rank's slice of a global batch (``chunk`` rule of ``Program.local_batch``)."""
    if global_tokens.shape[0] % dp_size:
        raise BaselineError(
            f"global batch {global_tokens.shape[0]} is not divisible by dp={dp_size}; use a multiple of {dp_size}"
        )
    return global_tokens.chunk(dp_size, 0)[dp_rank]


def micro_batches(tokens: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """``count`` equal micro-batches of a rank's rows."""
    if tokens.shape[0] % count:
        raise BaselineError(
            f"local batch {tokens.shape[0]} is not divisible by num_micro_batches={count}; "
            f"pass a global batch that gives a multiple of {count} rows per rank"
        )
    return tokens.chunk(count, 0)


def torch_optimizer(params: Sequence[nn.Parameter] | Any, config: OptimizerConfig, *, fused: bool = False):
    """``torch.optim.AdamW`` / ``SGD`` with the runtime's hyper-parameters (module docstring)."""
    if config.name == "adamw":
        extra = {"fused": True} if fused else {}
        return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                 weight_decay=config.weight_decay, **extra)
    if config.weight_decay:
        raise BaselineError(
            f"OptimizerConfig(name='sgd', weight_decay={config.weight_decay}): torch SGD couples decay into the "
            "gradient while the runtime decouples it; use weight_decay=0 or adamw"
        )
    return torch.optim.SGD(params, lr=config.lr)


def mean_over(value: torch.Tensor, group: Any = None) -> float:
    """Average of a scalar over ``group`` (the reported loss over data-parallel ranks)."""
    value = value.detach().float().reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return float(value)


# --------------------------------------------------------------------------- timing and memory


@dataclass(frozen=True)
class Measurement:
    """What one config's timed run produced (times in seconds, memory in bytes)."""

    losses: tuple[float, ...]  # every step, warm-up included
    step_times_s: tuple[float, ...]  # measured steps only, slowest rank each
    peak_memory_bytes: int | None  # max over ranks of max_memory_allocated; None on CPU
    peak_by_step: tuple[int, ...] = ()  # the same peak before the first step (the build), then after each step

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s) if self.step_times_s else float("nan")


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels (no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def reset_memory(device: torch.device | str) -> None:
    """Free cached blocks and reset the CUDA peak counter before a new config."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def reset_after_build(device: torch.device | str) -> int | None:
    """The peak so far (the config's build, the harness's reference model included), then reset the CUDA peak
    counter for the steps (module docstring, "Memory"); ``None`` on the CPU."""
    peak = peak_memory_bytes(device)
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return peak


def peak_memory_bytes(device: torch.device | str) -> int | None:
    """Max over ranks of ``torch.cuda.max_memory_allocated``; ``None`` on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(device)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _slowest(seconds: float, device: torch.device | str) -> float:
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def measure(step: Callable[[torch.Tensor], float], batches: Sequence[torch.Tensor], warmup: int,
            device: torch.device | str) -> Measurement:
    """Run ``step`` on every batch; time the ones after ``warmup`` (module docstring, "Timing")."""
    if not 0 <= warmup < len(batches):
        raise BaselineError(f"warmup={warmup} must be in [0, steps={len(batches)}); run more steps than warm-up")
    losses, times, peaks = [], [], [peak_memory_bytes(device)]
    for index, tokens in enumerate(batches):
        synchronize(device)
        start = time.perf_counter()
        losses.append(step(tokens))
        synchronize(device)
        elapsed = _slowest(time.perf_counter() - start, device)
        peaks.append(peak_memory_bytes(device))
        if index >= warmup:
            times.append(elapsed)
    return Measurement(tuple(losses), tuple(times), peak_memory_bytes(device),
                       tuple(p for p in peaks if p is not None))


def model_flops_per_step(graph: Any, spec: RunSpec) -> float:
    """``3·Σ forward_flops(B, S)`` over the captured graph's layers (fwd + 2× bwd, no recompute)."""
    return 3.0 * sum(layer.forward_flops(spec.global_batch, spec.seq_len) for layer in graph.layers)


def rank_device(device: str) -> torch.device:
    """``cuda:LOCAL_RANK`` (set as current) or the CPU."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BaselineUnavailable("device='cuda' but torch sees no CUDA device; pass --device cpu")
    import os

    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


__all__ = [
    "DATA_SEED",
    "SEED",
    "BaselineError",
    "BaselineUnavailable",
    "Measurement",
    "RunSpec",
    "Trainer",
    "hf_overrides",
    "is_hf_spec",
    "local_rows",
    "make_batches",
    "mean_over",
    "measure",
    "micro_batches",
    "model_flops_per_step",
    "peak_memory_bytes",
    "policy_loss",
    "prepare_reference",
    "rank_device",
    "reference_model",
    "reset_after_build",
    "reset_memory",
    "synchronize",
    "torch_optimizer",
]
