"""``TrainSpec``: what one optimizer step must do (batch, sequence, optimizer, schedule, precision).

The optimizer is typed: ``AdamW(...)`` or ``SGD(...)`` (hyper-parameters), an ``LRSchedule``
(warm-up, then constant / linear / cosine decay) and ``grad_clip`` (global-norm clipping). The
search reads only the optimizer's name (its bytes of state per parameter, K of the ZeRO paper);
the runtime (``runtime/optimizer.py``, ``OptimizerConfig.from_train``) reads everything.
A plan file records the name only: hyper-parameters and the schedule never change a plan, so a
plan is reused with any of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from autoshard.errors import AutoshardError

OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("bf16", "fp32")
COMM_PRECISIONS = ("exact", "auto")
LR_DECAYS = ("constant", "linear", "cosine")


def _positive(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise AutoshardError(f"{owner}.{name}={value!r}: must be a finite number > 0")


def _check_decay(owner: str, weight_decay: object) -> None:
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not 0 <= weight_decay < math.inf:
        raise AutoshardError(f"{owner}.weight_decay={weight_decay!r}: must be a finite number >= 0 (0 disables it)")


@dataclass(frozen=True, kw_only=True)
class AdamW:
    """AdamW, as ``torch.optim.AdamW`` (bias-corrected moments, ``eps`` outside the square root).

    Weight decay is decoupled: each step multiplies the parameter by ``1 - lr_t * weight_decay``
    (``lr_t`` the scheduled learning rate) before the Adam update.
    """

    name: ClassVar[str] = "adamw"

    lr: float = 1e-3
    """Peak learning rate; ``TrainSpec.lr_schedule`` scales it per step."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the bias-corrected square root of the second moment."""
    weight_decay: float = 0.0
    """Decoupled weight decay; 0 disables it."""
    decay_norms_and_biases: bool = False
    """Also decay 1-D parameters (norm gains, biases). Default False: only parameters whose global
    shape has two or more dims (matrices, embeddings) decay, the nanoGPT / Megatron convention."""

    def __post_init__(self) -> None:
        _positive("AdamW", "lr", self.lr)
        _positive("AdamW", "eps", self.eps)
        _check_decay("AdamW", self.weight_decay)
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise AutoshardError(f"AdamW.betas={self.betas!r}: must be two numbers in [0, 1), e.g. (0.9, 0.95)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))


@dataclass(frozen=True, kw_only=True)
class SGD:
    """Plain SGD: ``p -= lr_t * g`` (no momentum), after decoupled decay ``p *= 1 - lr_t * weight_decay``."""

    name: ClassVar[str] = "sgd"

    lr: float = 1e-3
    """Peak learning rate; ``TrainSpec.lr_schedule`` scales it per step."""
    weight_decay: float = 0.0
    """Decoupled weight decay; 0 disables it."""
    decay_norms_and_biases: bool = False
    """Also decay 1-D parameters (see ``AdamW.decay_norms_and_biases``)."""

    def __post_init__(self) -> None:
        _positive("SGD", "lr", self.lr)
        _check_decay("SGD", self.weight_decay)


OptimizerSpec = AdamW | SGD
_DEFAULT_OPTIMIZERS: dict[str, OptimizerSpec] = {"adamw": AdamW(), "sgd": SGD()}


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Learning-rate multiplier per optimizer step: linear warm-up, then a decay.

    For the step with 0-based index ``k`` (``k`` optimizer steps already taken), the learning
    rate is ``lr * factor(k)``:

    | ``k`` | ``factor(k)`` |
    | --- | --- |
    | ``k < warmup_steps`` | ``(k + 1) / warmup_steps`` |
    | ``warmup_steps <= k < total_steps`` | ``constant``: 1; ``linear``: ``1 - (1 - m) p``; ``cosine``: ``m + (1 - m)(1 + cos(pi p)) / 2`` |
    | ``k >= total_steps`` | ``constant``: 1; else ``m`` |

    with ``p = (k - warmup_steps) / (total_steps - warmup_steps)`` and ``m = min_lr_ratio``. The
    position is the optimizer's step counter, which checkpoints save: a resumed run continues the
    schedule where it stopped.
    """

    warmup_steps: int = 0
    """Steps of the linear warm-up; 0: none."""
    decay: str = "constant"
    """After warm-up: one of ``LR_DECAYS`` (``constant``, ``linear``, ``cosine``)."""
    total_steps: int | None = None
    """Step at which the decay reaches ``min_lr_ratio``; required by ``linear`` and ``cosine``."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of the peak ``lr``, in [0, 1]."""

    def __post_init__(self) -> None:
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise AutoshardError(f"LRSchedule.warmup_steps={self.warmup_steps!r}: must be an integer >= 0")
        if self.decay not in LR_DECAYS:
            raise AutoshardError(f"LRSchedule.decay={self.decay!r}: allowed {LR_DECAYS}")
        if not isinstance(self.min_lr_ratio, (int, float)) or not 0 <= self.min_lr_ratio <= 1:
            raise AutoshardError(f"LRSchedule.min_lr_ratio={self.min_lr_ratio!r}: must be in [0, 1]")
        if self.decay == "constant":
            return
        total = self.total_steps
        if isinstance(total, bool) or not isinstance(total, int) or total <= self.warmup_steps:
            raise AutoshardError(
                f"LRSchedule.total_steps={total!r}: decay={self.decay!r} needs an integer total_steps > "
                f"warmup_steps={self.warmup_steps} (the step where the decay ends); or use decay='constant'"
            )

    def factor(self, step: int) -> float:
        """The multiplier of the peak learning rate for the step with 0-based index ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        assert self.total_steps is not None  # __post_init__
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        floor = self.min_lr_ratio
        if self.decay == "linear":
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """One training step's shape and its optimizer.

    global_batch: sequences per optimizer step, over all data-parallel ranks.
    seq_len: tokens per sequence.
    micro_batch: sequences per forward/backward on one rank; ``None`` lets the
        search choose it.
    optimizer: ``"adamw"`` / ``"sgd"`` (default hyper-parameters) or a typed
        ``AdamW(...)`` / ``SGD(...)``. After construction ``optimizer`` is always the
        name (what the search prices: ``adamw`` K = 12 bytes/param of fp32 states incl.
        master, ``sgd`` K = 4, fp32 master only) and ``optimizer_config`` the typed
        hyper-parameters.
    optimizer_config: the typed hyper-parameters; filled from ``optimizer`` (leave it
        unset; given with a name, the two must agree).
    lr_schedule: warm-up and decay of the learning rate (``LRSchedule``; default constant).
    grad_clip: global-norm gradient clipping threshold (over all shards); ``None``
        disables clipping. Default 1.0.
    precision: compute/communication dtype; ``bf16`` keeps fp32 master weights.
    comm_precision: ``exact`` (default): every collective moves the values as a hand-written
        baseline would (``precision``'s dtype), and the search never picks a quantized wire
        (qwZ int8/fp8 weight gathers, qgZ int8/int4 gradient reductions) unless a pin asks for one;
        ``auto``: the search may choose them where they are faster (lossy: see
        ``kernels/quantized_collectives.py`` for the error bounds).
    """

    global_batch: int
    seq_len: int
    micro_batch: int | None = None
    optimizer: str | OptimizerSpec = "adamw"
    optimizer_config: OptimizerSpec | None = None
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    grad_clip: float | None = 1.0
    precision: str = "bf16"
    comm_precision: str = "exact"
    compiled: bool = True
    """Whether the runtime compiles the plan where it can (a GPU, ep = cp = 1); False prices the eager program,
    as PPO runs its programs (``runtime/ppo_program.build_engines``)."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise AutoshardError(f"TrainSpec.{name}={value!r}: must be a positive integer")
        if self.micro_batch is not None and (not isinstance(self.micro_batch, int) or self.micro_batch <= 0):
            raise AutoshardError(
                f"TrainSpec.micro_batch={self.micro_batch!r}: must be a positive integer or None (let the search choose)"
            )
        self._resolve_optimizer()
        if not isinstance(self.lr_schedule, LRSchedule):
            raise AutoshardError(
                f"TrainSpec.lr_schedule={self.lr_schedule!r}: expected an autoshard.LRSchedule, e.g. "
                "LRSchedule(warmup_steps=100, decay='cosine', total_steps=10_000)"
            )
        if self.grad_clip is not None:
            _positive("TrainSpec", "grad_clip", self.grad_clip)
        if self.precision not in PRECISIONS:
            raise AutoshardError(f"TrainSpec.precision={self.precision!r}: allowed {PRECISIONS}")
        if self.comm_precision not in COMM_PRECISIONS:
            raise AutoshardError(f"TrainSpec.comm_precision={self.comm_precision!r}: allowed {COMM_PRECISIONS}")

    def _resolve_optimizer(self) -> None:
        """Normalise ``optimizer`` to its name and ``optimizer_config`` to the typed hyper-parameters."""
        given, config = self.optimizer, self.optimizer_config
        if isinstance(given, (AdamW, SGD)):
            if config is not None and config != given:
                raise AutoshardError(
                    f"TrainSpec.optimizer={given!r} and optimizer_config={config!r} disagree; pass only optimizer"
                )
            given, config = given.name, given
        if given not in OPTIMIZERS:
            raise AutoshardError(
                f"TrainSpec.optimizer={given!r}: allowed {OPTIMIZERS} or autoshard.AdamW(...) / autoshard.SGD(...)"
            )
        if config is None:
            config = _DEFAULT_OPTIMIZERS[given]
        elif not isinstance(config, (AdamW, SGD)) or config.name != given:
            raise AutoshardError(
                f"TrainSpec.optimizer_config={config!r} is not the hyper-parameters of optimizer={given!r}; "
                f"pass optimizer=autoshard.{'AdamW' if given == 'adamw' else 'SGD'}(...) alone"
            )
        object.__setattr__(self, "optimizer", given)
        object.__setattr__(self, "optimizer_config", config)

    @property
    def optimizer_state_bytes_per_param(self) -> int:
        """K of the ZeRO paper: fp32 master + optimizer moments, bytes per parameter."""
        return 12 if self.optimizer == "adamw" else 4
