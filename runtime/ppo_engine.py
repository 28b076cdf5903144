"""The policy-engine interface PPO trains through, and its single-process adapter.

PPO never touches an ``nn.Module`` directly. It talks to a ``PolicyEngine``:

| member | contract |
| --- | --- |
| ``vocab_size``, ``max_seq_len``, ``device`` | the policy's logit width, longest sequence and where its inputs live |
| ``forward(tokens, *, cache=None, start_pos=0)`` | tokens [B, S] → (logits [B, S, V], values [B, S]) of the local batch |
| ``new_cache(batch, max_len)`` | a KV cache for ``forward(..., cache=)``, or None (rollout then recomputes prefixes) |
| ``train_mode()`` / ``eval_mode()`` | dropout on / off |
| ``zero_grad()``, ``backward(loss)`` | accumulate gradients of a scalar loss (micro-batches add up) |
| ``step() -> float`` | reduce gradients over data-parallel ranks with a SUM, clip by global norm, optimizer step; returns the pre-clip global gradient norm |
| ``dp`` | a ``Reducer``: the data-parallel group PPO all-reduces token counts and statistics over |
| ``state_dict()`` / ``load_state_dict()`` | weights for checkpoints and for building the reference policy |

[Note: gradient reduction is a SUM]
PPO divides every loss by the *global* token count of the mini-batch (all
micro-batches, all data-parallel ranks; ``Reducer.all_reduce_sum``), so each
rank's loss is already its share of the global mean. The engine must therefore
SUM gradients over the data-parallel group, never average them: summing shares
gives exactly the single-process gradient of the whole mini-batch.

``ModuleEngine`` implements the interface for one ``nn.Module`` and a torch
optimizer, optionally with a ``Reducer`` that spans several processes (then it
is plain data parallelism: full replicas, gradients all-reduced). The sharded
per-rank ``Program`` of the runtime implements the same members over its local
shards.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from autoshard.errors import AutoshardError


class EngineError(AutoshardError):
    """An engine was asked for something it cannot do (e.g. stepping a frozen reference)."""


@runtime_checkable
class Reducer(Protocol):
    """The data-parallel group seen by PPO: rank, size and an in-place SUM all-reduce."""

    rank: int
    world_size: int

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it."""
        ...


class LocalReducer:
    """One process: the all-reduce is the identity."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class DistReducer:
    """A ``torch.distributed`` process group (default: the world); SUM all-reduce (gloo or NCCL)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM, group=self._group)
        return tensor


@runtime_checkable
class PolicyEngine(Protocol):
    """See the module docstring for the contract of each member."""

    vocab_size: int
    max_seq_len: int
    device: torch.device
    dp: Reducer

    def forward(self, tokens: torch.Tensor, *, cache: Any = None, start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def new_cache(self, batch: int, max_len: int) -> Any:
        ...

    def train_mode(self) -> None:
        ...

    def eval_mode(self) -> None:
        ...

    def zero_grad(self) -> None:
        ...

    def backward(self, loss: torch.Tensor) -> None:
        ...

    def step(self) -> float:
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        ...


class ModuleEngine:
    """``PolicyEngine`` over one ``nn.Module`` (a reference policy: ``forward -> (logits, values)``).

    ``optimizer=None`` makes a frozen engine (reference policy): parameters get
    ``requires_grad=False`` and ``backward``/``step`` raise ``EngineError``.
    ``max_grad_norm=None`` disables clipping (the norm is still measured).
    With ``dp`` spanning several processes every rank holds a full replica and
    ``step`` all-reduces gradients with a SUM (module note above).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        max_grad_norm: float | None = 1.0,
        dp: Reducer | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.dp = dp if dp is not None else LocalReducer()
        self.vocab_size = int(model.config.vocab_size)
        self.max_seq_len = int(model.config.max_seq_len)
        self.device = next(model.parameters()).device
        if optimizer is None:
            model.requires_grad_(False)

    @classmethod
    def frozen_copy(cls, engine: "ModuleEngine", model: nn.Module) -> "ModuleEngine":
        """A frozen engine over ``model`` loaded with ``engine``'s current weights (a reference policy)."""
        model.load_state_dict(engine.state_dict())
        return cls(model, None, dp=engine.dp)

    def forward(self, tokens: torch.Tensor, *, cache: Any = None, start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S] → (logits [B, S, V], values [B, S])."""
        if cache is None:
            return self.model(tokens)
        return self.model(tokens, cache=cache, start_pos=start_pos)

    def new_cache(self, batch: int, max_len: int) -> Any:
        """The model's KV cache, or None when it has no ``new_cache``."""
        make = getattr(self.model, "new_cache", None)
        return make(batch, max_len) if make is not None else None

    def train_mode(self) -> None:
        self.model.train()

    def eval_mode(self) -> None:
        self.model.eval()

    def _require_optimizer(self, what: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise EngineError(f"cannot {what} a frozen engine (built with optimizer=None); pass an optimizer")
        return self.optimizer

    def zero_grad(self) -> None:
        self._require_optimizer("zero_grad").zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        self._require_optimizer("backward through")
        loss.backward()

    def step(self) -> float:
        """SUM-reduce gradients over ``dp``, clip, step; return the pre-clip global gradient norm."""
        optimizer = self._require_optimizer("step")
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp.world_size > 1:
            for p in params:
                self.dp.all_reduce_sum(p.grad)
        max_norm = float("inf") if self.max_grad_norm is None else self.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return float(norm)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
