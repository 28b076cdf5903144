"""Megatron-Core tensor-parallel baseline (GPU only): Column/RowParallelLinear in the reference blocks.

``MegatronPolicy`` rebuilds the reference policy (Llama, and GPT with its tied embedding and
head) from the seeded reference weights, tensor-parallel over the whole world (tp = world
size, dp = 1), in Megatron's ``[s, b, h]`` layout:

    tokens [b, s] → VocabParallelEmbedding (+ all-reduce) → transpose → [s, b, h]
      (+ pos_embed, GPT) → scatter_to_sequence_parallel_region          (SP only)
    block:  x + o(attention(q(n1(x)), k(·), v(·)))      q/k/v ColumnParallel, o RowParallel
            x + down(act(up(n2(x))) [· gate])            up/gate ColumnParallel, down RowParallel
    norm → head ColumnParallel (logits stay vocab-parallel [s, b, V/tp]);  value_head replicated

Vocabulary (``padded_vocab``): a vocabulary tp divides is kept; otherwise (GPT's 50257) it is
padded as Megatron-LM pads it (``--make-vocab-size-divisible-by 128``: to a multiple of
128·tp). The padded rows start at zero and their logits are masked to −∞ before the
cross-entropy (``mask_padded_logits``), so the softmax, the loss and every real gradient are
the reference model's; the padded rows get zero gradients and stay out of the loss.

Tied embedding and head (GPT, ``tie_embeddings``): the vocab-parallel embedding and the
column-parallel head shard the same dimension (vocabulary rows), so the head is built with
``skip_weight_param_allocation=True`` and called with the embedding's local shard, as
Megatron-Core's ``GPTModel`` does with ``share_embeddings_and_output_weights`` inside one
pipeline stage: one parameter per rank, whose gradient autograd accumulates from both uses.

Sequence parallel (``MegatronOptions.sequence_parallel``): the norm/residual regions hold
``s/tp`` positions; column layers all-gather their input, row layers reduce-scatter their
output (Megatron-Core does both when ``config.sequence_parallel``). Parameters replicated over
tp that see only a sequence shard (norms, value head, row-parallel biases) get their gradients
all-reduced over tp after backward, as Megatron's ``finalize_model_grads`` does.

Loss = ``common.policy_loss`` computed in parallel: ``vocab_parallel_cross_entropy`` on the
vocab-parallel logits (the same value as a cross-entropy of the gathered logits) plus the value
MSE, whose per-rank partial sum under SP is combined by ``reduce_from_tensor_model_parallel_region``
(all-reduce forward, identity backward: the gradient of a replicated sum).

Precision: bf16 parameters for compute with fp32 master copies the optimizer updates (what
Megatron's ``Float16OptimizerWithFloat16Params`` does); clipping on the fp32 gradients with
the global norm ``‖g‖² = Σ_tp Σ_sharded ‖g‖² + Σ_replicated ‖g‖²``.

Partial: no data parallelism next to tp, no pipeline parallelism; attention through
``F.scaled_dot_product_attention`` (flash on GPUs). The trainer refuses the CPU (Megatron's
SP and RNG paths need CUDA); the vocabulary padding, slicing and tying are checked on the CPU
(``tests/test_baselines.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoshard.models.layers import apply_rope, rope_tables
from benchmarks.baselines.common import (
    BaselineError,
    BaselineUnavailable,
    RunSpec,
    micro_batches,
    reference_model,
    torch_optimizer,
)


VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default


@dataclass(frozen=True, kw_only=True)
class MegatronOptions:
    """sequence_parallel: Megatron SP in the norm/residual regions (Korthikanti et al.)."""

    sequence_parallel: bool = False


def padded_vocab(vocab: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``vocab`` when tp divides it, else the next multiple of ``multiple·tp`` (module docstring)."""
    if vocab % tp == 0:
        return vocab
    step = multiple * tp
    return -(-vocab // step) * step


def vocab_shard(weight: torch.Tensor, tp: int, rank: int, padded: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a ``[V, h]`` weight first padded with zero rows to ``[padded, h]``."""
    extra = padded - weight.shape[0]
    if extra < 0 or padded % tp:
        raise BaselineError(f"padded vocabulary {padded} must be >= {weight.shape[0]} and divisible by tp={tp}")
    if extra:
        weight = torch.cat([weight, weight.new_zeros(extra, weight.shape[1])])
    return weight.chunk(tp, 0)[rank]


def mask_padded_logits(logits: torch.Tensor, vocab: int, rank: int) -> torch.Tensor:
    """Vocab-parallel logits ``[..., V_pad/tp]`` with the columns of padded ids (>= ``vocab``) set to −∞."""
    per_rank = logits.shape[-1]
    start = rank * per_rank
    if start + per_rank <= vocab:
        return logits
    ids = torch.arange(start, start + per_rank, device=logits.device)
    return logits.masked_fill(ids >= vocab, float("-inf"))


def _import_megatron():
    try:
        from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel
    except ImportError as err:
        raise BaselineUnavailable(f"megatron-core is not installed ({err}); install the carried wheel") from err
    return ModelParallelConfig, parallel_state, tensor_parallel


def _no_init(weight: torch.Tensor) -> None:
    """Weights are copied from the reference model; Megatron must not initialise them."""


class _Linears:
    """Builds Column/RowParallelLinear holding this rank's slice of a reference ``nn.Linear``."""

    def __init__(self, config, tensor_parallel, tp: int, rank: int):
        self.config, self.tp, self.rank, self.mp = config, tp, rank, tensor_parallel

    def column(self, ref: nn.Linear) -> nn.Module:
        layer = self.mp.ColumnParallelLinear(ref.in_features, ref.out_features, config=self.config,
                                             init_method=_no_init, bias=ref.bias is not None,
                                             gather_output=False, skip_bias_add=False)
        with torch.no_grad():
            layer.weight.copy_(ref.weight.chunk(self.tp, 0)[self.rank])
            if ref.bias is not None:
                layer.bias.copy_(ref.bias.chunk(self.tp, 0)[self.rank])
        return layer

    def head(self, ref: nn.Linear, vocab: int, *, tied: bool) -> nn.Module:
        """The vocab-parallel head over ``vocab`` (padded) rows; ``tied``: no weight of its own (module docstring)."""
        layer = self.mp.ColumnParallelLinear(ref.in_features, vocab, config=self.config, init_method=_no_init,
                                             bias=False, gather_output=False, skip_bias_add=False,
                                             skip_weight_param_allocation=tied)
        if not tied:
            with torch.no_grad():
                layer.weight.copy_(vocab_shard(ref.weight.detach(), self.tp, self.rank, vocab))
        return layer

    def row(self, ref: nn.Linear) -> nn.Module:
        layer = self.mp.RowParallelLinear(ref.in_features, ref.out_features, config=self.config,
                                          init_method=_no_init, bias=ref.bias is not None,
                                          input_is_parallel=True, skip_bias_add=False)
        with torch.no_grad():
            layer.weight.copy_(ref.weight.chunk(self.tp, 1)[self.rank])
            if ref.bias is not None:
                layer.bias.copy_(ref.bias)
        return layer


class _Block(nn.Module):
    """One reference block with tensor-parallel projections; x is [s(/tp), b, h]."""

    def __init__(self, ref: nn.Module, linears: _Linears, head_dim: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = ref.attn_norm, ref.mlp_norm
        attn, mlp = ref.attn, ref.mlp
        self.q, self.k, self.v, self.o = (linears.column(attn.q), linears.column(attn.k), linears.column(attn.v),
                                          linears.row(attn.o))
        self.up, self.down = linears.column(mlp.up), linears.row(mlp.down)
        self.gate = linears.column(mlp.gate) if hasattr(mlp, "gate") else None
        self.head_dim, self.kv_repeat = head_dim, attn.kv_repeat

    def _heads(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out, _ = proj(x)  # [s, b, heads_local·d]
        s, b, _ = out.shape
        return out.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3)  # [b, heads_local, s, d]

    def _attention(self, x: torch.Tensor, rope) -> torch.Tensor:
        q, k, v = self._heads(self.q, x), self._heads(self.k, x), self._heads(self.v, x)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.kv_repeat > 1:
            k, v = (t.repeat_interleave(self.kv_repeat, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, a_local, s, d]
        b, a, s, d = out.shape
        return self.o(out.permute(2, 0, 1, 3).reshape(s, b, a * d))[0]  # [s(/tp), b, h]

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up(x)[0]
        hidden = F.silu(self.gate(x)[0]) * up if self.gate is not None else F.gelu(up, approximate="tanh")
        return self.down(hidden)[0]

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self._attention(self.attn_norm(x), rope)
        return x + self._mlp(self.mlp_norm(x))


class MegatronPolicy(nn.Module):
    """The reference policy, tensor-parallel with Megatron-Core layers (module docstring)."""

    def __init__(self, ref: nn.Module, config, tensor_parallel, tp: int, rank: int):
        super().__init__()
        cfg = ref.config
        if ref.head.bias is not None:
            raise BaselineError(f"{type(ref).__name__}.head has a bias; the Megatron baseline's head has none")
        self.mp, self.sp, self.cfg, self.rank = tensor_parallel, config.sequence_parallel, cfg, rank
        self.tied = bool(getattr(cfg, "tie_embeddings", False))
        self.vocab = padded_vocab(cfg.vocab_size, tp)
        linears = _Linears(config, tensor_parallel, tp, rank)
        self.embed = tensor_parallel.VocabParallelEmbedding(self.vocab, cfg.hidden, init_method=_no_init,
                                                             config=config)
        with torch.no_grad():
            self.embed.weight.copy_(vocab_shard(ref.embed.weight.detach(), tp, rank, self.vocab))
        self.pos_embed = getattr(ref, "pos_embed", None)
        self.blocks = nn.ModuleList(_Block(block, linears, cfg.head_dim) for block in ref.blocks)
        self.norm, self.value_head = ref.norm, ref.value_head
        self.head = linears.head(ref.head, self.vocab, tied=self.tied)

    def head_weight(self) -> torch.Tensor:
        """This rank's ``[V_pad/tp, h]`` head weight: the embedding's shard when tied."""
        return self.embed.weight if self.tied else self.head.weight

    def sequence_sharded_params(self) -> list[nn.Parameter]:
        """Replicated parameters that see a sequence shard under SP (gradients all-reduced over tp)."""
        out = [*self.norm.parameters(), *self.value_head.parameters()]
        for block in self.blocks:
            out += [*block.attn_norm.parameters(), *block.mlp_norm.parameters()]
            out += [p for p in (block.o.bias, block.down.bias) if p is not None]
        return out

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [b, s] → (vocab-parallel logits [s, b, V/tp], values [s(/tp), b])."""
        x = self.embed(tokens).transpose(0, 1).contiguous()  # [s, b, h]
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)[:, None, :]
        rope = None if self.pos_embed is not None else rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        if self.sp:
            x = self.mp.scatter_to_sequence_parallel_region(x)  # [s/tp, b, h]
        for block in self.blocks:
            x = block(x, rope)
        x = self.norm(x)
        # Megatron-Core passes the shared weight the same way (GPTModel.output_layer(..., weight=)).
        logits = self.head(x, weight=self.embed.weight)[0] if self.tied else self.head(x)[0]
        return logits, self.value_head(x).squeeze(-1)

    def loss(self, outputs: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """``common.policy_loss`` on parallel outputs (module docstring)."""
        logits, values = outputs
        target = tokens.t()[1:].contiguous()  # [s-1, b]
        logits = mask_padded_logits(logits[:-1].float().contiguous(), self.cfg.vocab_size, self.rank)
        ce = self.mp.vocab_parallel_cross_entropy(logits, target).mean()
        squares = values.float().pow(2).sum()
        if self.sp:
            squares = self.mp.reduce_from_tensor_model_parallel_region(squares.reshape(1))[0]
        return ce + squares / tokens.numel()


class MegatronTPTrainer:
    """Tensor parallelism over every rank with Megatron-Core layers; fp32 masters, AdamW, clipping."""

    def __init__(self, spec: RunSpec, device: torch.device, options: MegatronOptions = MegatronOptions(), *,
                 name: str = "megatron-tp"):
        if device.type != "cuda":
            raise BaselineUnavailable("the Megatron-Core baseline is GPU-only (its SP and RNG paths need CUDA)")
        model_parallel_config, self.parallel_state, tensor_parallel = _import_megatron()
        self.name, self.spec, self.device = name, spec, device
        tp, rank = dist.get_world_size(), dist.get_rank()
        self.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        config = model_parallel_config(
            tensor_model_parallel_size=tp, sequence_parallel=options.sequence_parallel and tp > 1,
            params_dtype=spec.compute_dtype, use_cpu_initialization=True, perform_initialization=False,
            gradient_accumulation_fusion=False,
        )
        ref = reference_model(spec, "cpu")
        self.model = MegatronPolicy(ref, config, tensor_parallel, tp, rank).to(device, spec.compute_dtype)
        self.tp_group = self.parallel_state.get_tensor_model_parallel_group()
        self.params = list(self.model.parameters())
        sharded = self._sharded_ids()
        self.replicated = [p for p in self.params if id(p) not in sharded]
        sequence_sharded = {id(p) for p in self.model.sequence_sharded_params()}
        self.sp_params = [p for p in self.params if id(p) in sequence_sharded] if config.sequence_parallel else []
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch_optimizer(self.masters, spec.optimizer, fused=True)

    def _sharded_ids(self) -> set[int]:
        """Parameters split over tp: the embedding (= the tied head), column weights and biases, row weights."""
        layers = [m for m in self.model.modules() if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear")]
        ids = {id(self.model.embed.weight)}
        for m in layers:
            if m.weight is not None:  # None: the tied head, whose weight is the embedding's
                ids.add(id(m.weight))
            if type(m).__name__ == "ColumnParallelLinear" and m.bias is not None:
                ids.add(id(m.bias))
        return ids

    def step(self, global_tokens: torch.Tensor) -> float:
        """Every rank runs the whole batch (dp = 1), micro-batch by micro-batch; then one update."""
        chunks = micro_batches(global_tokens.to(self.device), self.spec.num_micro_batches)
        total = torch.zeros((), device=self.device)
        for micro in chunks:
            loss = self.model.loss(self.model(micro), micro) / len(chunks)
            loss.backward()
            total += loss.detach().float()
        self._sync_and_update()
        return float(total)

    def _sync_and_update(self) -> None:
        for p in self.sp_params:  # partial gradients of sequence shards
            dist.all_reduce(p.grad, group=self.tp_group)
        for master, p in zip(self.masters, self.params):
            master.grad = p.grad.float() if p.grad is not None else torch.zeros_like(master)
            p.grad = None
        self.last_grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, p in zip(self.masters, self.params):
                p.copy_(master)

    def _clip(self) -> float:
        replicated = {id(p) for p in self.replicated}
        sharded_sq = torch.zeros((), device=self.device)
        replicated_sq = torch.zeros((), device=self.device)
        for master, p in zip(self.masters, self.params):
            sq = master.grad.pow(2).sum()
            if id(p) in replicated:
                replicated_sq += sq
            else:
                sharded_sq += sq
        dist.all_reduce(sharded_sq, group=self.tp_group)
        norm = float((sharded_sq + replicated_sq).sqrt())
        max_norm = self.spec.optimizer.max_grad_norm
        if max_norm is not None and norm > max_norm:
            for master in self.masters:
                master.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def close(self) -> None:
        """Destroy Megatron's model-parallel groups so the next config starts clean."""
        del self.model, self.params, self.masters, self.optimizer
        self.parallel_state.destroy_model_parallel()


__all__ = ["MegatronOptions", "MegatronPolicy", "MegatronTPTrainer", "mask_padded_logits", "padded_vocab",
           "vocab_shard"]
