"""A tensor-parallel rollout replica: the policy's architecture with Megatron shards of its own degree.

The rollout layout is ``tp = r`` ranks per generation group (``r``
consecutive global ranks, inside one node), ``world / r`` groups. Each rank
of a group holds 1/r of every column-, row- and vocab-parallel parameter
(the model's ``tp_roles()``, as Megatron-LM and vLLM split them) and the
whole of every replicated one (norms, value head, position table):

| role | rollout shard | forward |
| --- | --- | --- |
| ``column`` (q, k, v, up, gate) | rows j·n/r … (j+1)·n/r of weight and bias | the plain ``nn.Linear`` on the shard: local heads / local MLP width |
| ``row`` (o, down) | columns j·n/r … of the weight; the bias whole | ``_RowLinear``: x·Wⱼᵀ, all-reduce over the group, then + bias once |
| ``vocab`` (embed, head; tied or not) | vocabulary rows j·V/r … | ``_VocabEmbedding``: look up the ids this rank owns, zero the rest, all-reduce; ``_VocabHead``: local logits, all-gather along the vocabulary |
| ``replicate`` | whole | unchanged |

The attention layers never write head counts into views (``models/layers.py``),
so local heads need no other change; the KV cache holds the local key/value
heads (``new_cache``). Divisibility (``rollout_refusal``): r must divide the
heads, the key/value heads and the MLP width of every block; a vocabulary r does
not divide stays replicated (priced so: ``search/rollout.py``). Expert
parameters (MoE) are not split: a MoE policy rolls out with r = 1.

Every rank of a group feeds the same tokens, so every rank gets the same
logits: the all-reduce delivers identical bytes to every member and the head's
all-gather is a copy (the ``rollout_engine`` note "rank consistency").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.errors import AutoshardError
from autoshard.graph import rollout_shard_dim, rollout_split_refusal
from autoshard.models.layers import KVCache
from autoshard.kernels import collectives



class RolloutLayoutError(AutoshardError):
    """A rollout layout the policy cannot take (heads, key/value heads or MLP width not divisible)."""


def rollout_refusal(model: nn.Module, tp: int) -> str | None:
    """Why ``model`` cannot roll out on ``tp`` ranks per group, or None (module docstring: divisibility;
    the rule is ``graph.rollout_split_refusal``, which the search applies to the traced graph)."""
    if tp == 1:
        return None
    config = getattr(model, "config", None)
    roles = model.tp_roles() if hasattr(model, "tp_roles") else None
    if config is None or roles is None:
        return "the policy has no tp_roles(): only the reference models' layers are split for rollout"
    heads, kv = config.num_heads, getattr(config, "num_kv_heads", None) or config.num_heads
    widths = [("attention heads", heads, ""), ("key/value heads", kv, ""), ("MLP width", config.ffn_hidden, "")]
    return rollout_split_refusal(tp, widths, experts="expert" in roles.values())


def shard_dim(role: str, shape: tuple[int, ...], tp: int) -> int | None:
    """The dimension a parameter of ``role`` and ``shape`` is split along on ``tp`` rollout ranks, or None."""
    dim = rollout_shard_dim(role, shape, tp)
    if dim is not None and shape[dim] % tp:
        if role == "vocab":
            return None  # replicated vocabulary (module docstring)
        raise RolloutLayoutError(f"rollout tp={tp} does not divide dim {dim} of a {role} parameter {shape}")
    return dim


def local_shape(shape: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    """``shape`` with ``dim`` divided by ``tp`` (unchanged for None)."""
    if dim is None:
        return tuple(shape)
    return (*shape[:dim], shape[dim] // tp, *shape[dim + 1:])


class _RowLinear(nn.Module):
    """Row-parallel linear: local input features, partial output summed over the group, bias once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = collectives.all_reduce(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class _VocabEmbedding(nn.Module):
    """Vocabulary-parallel embedding: rows [start, start + V/r) of the table on this rank."""

    def __init__(self, weight: torch.Tensor, start: int, group: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return collectives.all_reduce(out, self.group)


class _VocabHead(nn.Module):
    """Vocabulary-parallel LM head: local logits, gathered along the vocabulary (every rank gets all V)."""

    def __init__(self, weight: torch.Tensor, group: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_gather(F.linear(x, self.weight), -1, self.group)


def build_sharded_replica(
    model: nn.Module, tp: int, rank_in_group: int, group: str | None, *, device: torch.device | str, dtype: torch.dtype
) -> tuple[nn.Module, dict[str, int | None]]:
    """The rollout replica of ``model`` for rank ``rank_in_group`` of a ``tp``-rank group named ``group``.

    Returns (replica, shard dims by parameter FQN). Built on ``meta``, split,
    then materialised with ``to_empty``: its weights are garbage until the
    first sync. ``tp == 1``: the whole model (``group`` unused).
    """
    reason = rollout_refusal(model, tp)
    if reason:
        raise RolloutLayoutError(reason)
    with torch.device("meta"):
        replica = type(model)(model.config)
    roles = replica.tp_roles() if tp > 1 else {}
    dims: dict[str, int | None] = {}
    for name, param in list(replica.named_parameters()):
        dims[name] = shard_dim(roles.get(name, "replicate"), tuple(param.shape), tp)
    if tp > 1:
        canonical = {id(p): n for n, p in replica.named_parameters()}
        for name, param in replica.named_parameters(remove_duplicate=False):  # a tied head: its owner's role
            roles.setdefault(name, roles.get(canonical[id(param)], "replicate"))
            dims.setdefault(name, dims[canonical[id(param)]])
        _split_modules(replica, dims, roles, tp, rank_in_group, group)
    replica = replica.to(dtype).to_empty(device=device)
    replica.tie_weights()
    replica.requires_grad_(False)
    return replica.eval(), {name: dims[name] for name, _ in replica.named_parameters()}


def _split_modules(replica: nn.Module, dims: dict[str, int | None], roles: dict[str, str], tp: int, j: int,
                   group: str | None) -> None:
    """Swap row and vocabulary modules for their parallel forms and shrink column parameters (on meta)."""
    assert group is not None
    for module_name, module in list(replica.named_modules()):
        weight_name = f"{module_name}.weight" if module_name else "weight"
        role = roles.get(weight_name)
        if role is None or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        shape = tuple(module.weight.shape)
        new_weight = torch.empty(local_shape(shape, dims[weight_name], tp), device="meta")
        if role == "row":
            bias = None if getattr(module, "bias", None) is None else torch.empty_like(module.bias)
            _set_module(replica, module_name, _RowLinear(new_weight, bias, group))
        elif role == "vocab" and dims[weight_name] is not None:
            start = j * shape[0] // tp
            new = _VocabEmbedding(new_weight, start, group) if isinstance(module, nn.Embedding) else _VocabHead(new_weight, group)
            _set_module(replica, module_name, new)
        elif role == "column":
            module.weight = nn.Parameter(new_weight)
            if module.bias is not None:
                module.bias = nn.Parameter(torch.empty(local_shape(tuple(module.bias.shape), 0, tp), device="meta"))


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def new_cache(model: nn.Module, tp: int, batch: int, max_len: int, *, device: Any, dtype: torch.dtype) -> KVCache:
    """An empty KV cache of the local key/value heads (num_kv_heads / tp) for the sharded replica."""
    cfg = model.config
    kv = getattr(cfg, "num_kv_heads", None) or cfg.num_heads
    return KVCache(num_layers=cfg.num_layers, batch=batch, num_kv_heads=kv // tp, max_len=max_len,
                   head_dim=cfg.head_dim, device=device, dtype=dtype)


__all__ = ["RolloutLayoutError", "build_sharded_replica", "local_shape", "new_cache",
           "rollout_refusal", "shard_dim"]
