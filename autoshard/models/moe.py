"""Mixture-of-Experts layer: top-k router and stacked SwiGLU experts, export-friendly.

Routing (Mixtral): p = softmax(router(x)) over E experts in fp32, keep the
top-k per token, renormalise the k weights to sum to 1.

Expert computation — decision: *capacity-buffer dispatch* (GShard / Switch
style) with shapes that depend only on T = number of tokens, never on routing:

    C         = T                          (dropless, ``capacity_factor=None``)
              = min(T, ⌈factor·k·T / E⌉)    (otherwise)
    dispatch:   x [T, h] → buffer [E, C, h]  (index_add of each kept assignment)
    experts:    bmm with w_gate/w_up [E, f, h], w_down [E, h, f] → [E, C, h]
    combine:    out[t] = Σ_j  w[t, j] · buffer_out[slot(t, j)]

Why: ``torch.export`` must trace one graph valid for any batch and sequence.
A per-expert loop over data-dependent token counts needs unbacked symbolic
sizes or grouped-GEMM kernels that are CUDA-only; a dense "every expert on
every token" formulation hides the routing from the graph. The buffer form is
plain bmm / index_add / cumsum with sizes in T, so it exports with dynamic
batch and sequence, its graph FLOPs are E·C·6hf per layer (= factor·k·T·6hf
with a capacity factor), and expert parallelism is an all-to-all of the
[E, C, h] buffer along E. Cost: in dropless mode C = T is the worst case
(every token on one expert), so the graph computes E/k times the useful expert
FLOPs; capture should price MoE layers by ``top_k`` (the ``LayerInfo`` records
``num_experts`` and ``top_k``), and a capacity factor is the efficient choice.

Drop order (deterministic): assignments are queued slot-major — every token's
first choice before any token's second choice — and within a slot in
flattened (batch, sequence) token order; an assignment whose expert already
holds C tokens is dropped (contributes 0; the residual carries the token).
Drops therefore depend on the other tokens of the same forward call: with a
capacity factor, incremental decoding does not reproduce a full forward.

Auxiliary load-balancing loss (Switch Transformer, Fedus et al. 2021):
aux = E · Σ_e f_e · P_e, f_e = share of the k·T assignments routed to e
(before drops), P_e = mean router probability of e.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Routing(NamedTuple):
    """Where each of the k·T assignments goes. Rows are slot-major: row j·T + t is token t's j-th choice."""

    weights: torch.Tensor  # [k, T] combine weights (renormalised top-k probabilities)
    experts: torch.Tensor  # [k, T] expert index
    slot: torch.Tensor  # [k, T] row of the flattened [E·C] buffer, or E·C when dropped
    kept: torch.Tensor  # [k, T] bool
    capacity: int  # C (a SymInt under export)
    probs: torch.Tensor  # [T, E] full router probabilities (fp32)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """C of the module docstring; integer arithmetic only, so it stays symbolic under export."""
    if capacity_factor is None:
        return num_tokens
    ratio = Fraction(capacity_factor).limit_denominator(1 << 16)
    numerator = num_tokens * top_k * ratio.numerator
    denominator = num_experts * ratio.denominator
    return torch.sym_min(num_tokens, (numerator + denominator - 1) // denominator)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts: x [B, S, h] → [B, S, h]."""

    def __init__(
        self,
        *,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
        dropout: float,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.dropout = nn.Dropout(dropout)
        bound = 1.0 / math.sqrt(hidden)
        for weight in (self.w_gate, self.w_up, self.w_down):
            nn.init.uniform_(weight, -bound, bound)

    def route(self, x: torch.Tensor) -> Routing:
        """Routing decisions for tokens x [T, h] (see the module docstring for the drop order)."""
        num_tokens = x.shape[0]
        probs = self.router(x).softmax(dim=-1, dtype=torch.float32)  # [T, E]
        top_p, top_e = probs.topk(self.top_k, dim=-1)  # [T, k]
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        experts = top_e.t()  # [k, T]
        expert_ids = torch.arange(self.num_experts, device=x.device)
        onehot = (experts[..., None] == expert_ids).to(torch.int32)  # [k, T, E]
        flat = onehot.reshape(-1, self.num_experts)  # [k·T, E] slot-major queue
        position = ((flat.cumsum(dim=0) - 1) * flat).sum(dim=-1).view_as(experts)  # [k, T]
        capacity = expert_capacity(num_tokens, self.num_experts, self.top_k, self.capacity_factor)
        kept = position < capacity
        slot = torch.where(kept, experts * capacity + position, self.num_experts * capacity)
        return Routing(top_p.t().to(x.dtype), experts, slot, kept, capacity, probs)

    def load_balancing_loss(self, routing: Routing) -> torch.Tensor:
        """Switch-Transformer auxiliary loss E · Σ_e f_e · P_e (module docstring) of one routing."""
        expert_ids = torch.arange(self.num_experts, device=routing.experts.device)
        assigned = (routing.experts.reshape(-1, 1) == expert_ids).to(torch.float32)  # [k·T, E]
        share = assigned.mean(dim=0)  # [E]
        return self.num_experts * (share * routing.probs.mean(dim=0)).sum()

    def experts_forward(self, buffer: torch.Tensor) -> torch.Tensor:
        """SwiGLU of every expert on its own rows: buffer [E, C, h] → [E, C, h]."""
        gate = torch.bmm(buffer, self.w_gate.transpose(1, 2))  # [E, C, f]
        up = torch.bmm(buffer, self.w_up.transpose(1, 2))  # [E, C, f]
        return torch.bmm(F.silu(gate) * up, self.w_down.transpose(1, 2))  # [E, C, h]

    def dispatch_combine(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Run the experts on tokens [T, h] as ``routing`` says; returns [T, h]."""
        hidden = tokens.shape[1]
        rows = self.num_experts * routing.capacity
        buffer = tokens.new_zeros(rows + 1, hidden)  # last row collects dropped assignments
        for j in range(self.top_k):
            buffer = buffer.index_add(0, routing.slot[j], tokens)
        expert_out = self.experts_forward(buffer[:rows].view(self.num_experts, -1, hidden))
        expert_out = torch.cat([expert_out.reshape(rows, hidden), expert_out.new_zeros(1, hidden)])  # [E·C+1, h]
        out = tokens.new_zeros(tokens.shape)
        for j in range(self.top_k):
            out = out + routing.weights[j, :, None] * expert_out.index_select(0, routing.slot[j])
        return out

    def forward_with_aux(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, h] → (out [B, S, h], load-balancing loss [])."""
        out, routing = self._forward(x)
        return out, self.load_balancing_loss(routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, h] → [B, S, h]."""
        return self._forward(x)[0]

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        tokens = x.reshape(-1, x.shape[-1])  # [T, h]
        routing = self.route(tokens)
        out = self.dispatch_combine(tokens, routing).view_as(x)  # [B, S, h]
        if self.dropout.p > 0:
            out = self.dropout(out)
        return out, routing
