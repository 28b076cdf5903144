"""``TrainSpec``: what one optimizer step must do (batch, sequence, optimizer, precision)."""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import AutoshardError

OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("bf16", "fp32")
COMM_PRECISIONS = ("exact", "auto")


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """One training step's shape.

    global_batch: sequences per optimizer step, over all data-parallel ranks.
    seq_len: tokens per sequence.
    micro_batch: sequences per forward/backward on one rank; ``None`` lets the
        search choose it.
    optimizer: ``adamw`` (K = 12 bytes/param of fp32 states incl. master) or
        ``sgd`` (K = 4, fp32 master only).
    precision: compute/communication dtype; ``bf16`` keeps fp32 master weights.
    comm_precision: ``exact`` (default): every collective moves the values as a hand-written
        baseline would (``precision``'s dtype), and the search never picks a quantized wire
        (qwZ int8/fp8 weight gathers, qgZ int8/int4 gradient reductions) unless a pin asks for one;
        ``auto``: the search may choose them where they are faster (lossy: see
        ``runtime/quantized_collectives.py`` for the error bounds).
    """

    global_batch: int
    seq_len: int
    micro_batch: int | None = None
    optimizer: str = "adamw"
    precision: str = "bf16"
    comm_precision: str = "exact"

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise AutoshardError(f"TrainSpec.{name}={value!r}: must be a positive integer")
        if self.micro_batch is not None and (not isinstance(self.micro_batch, int) or self.micro_batch <= 0):
            raise AutoshardError(
                f"TrainSpec.micro_batch={self.micro_batch!r}: must be a positive integer or None (let the search choose)"
            )
        if self.optimizer not in OPTIMIZERS:
            raise AutoshardError(f"TrainSpec.optimizer={self.optimizer!r}: allowed {OPTIMIZERS}")
        if self.precision not in PRECISIONS:
            raise AutoshardError(f"TrainSpec.precision={self.precision!r}: allowed {PRECISIONS}")
        if self.comm_precision not in COMM_PRECISIONS:
            raise AutoshardError(f"TrainSpec.comm_precision={self.comm_precision!r}: allowed {COMM_PRECISIONS}")

    @property
    def optimizer_state_bytes_per_param(self) -> int:
        """K of the ZeRO paper: fp32 master + optimizer moments, bytes per parameter."""
        return 12 if self.optimizer == "adamw" else 4
