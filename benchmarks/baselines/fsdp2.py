"""Hand-written FSDP2 baseline: ``fully_shard`` per block, then the root.

What it builds (the torchtitan recipe, data parallel over the whole world):

- the reference policy from ``common.reference_model`` (fp32, seed ``SEED``);
- a 1-D ``DeviceMesh`` of every rank; ``fully_shard(block)`` for each
  ``model.blocks[i]`` and ``fully_shard(model)`` for the rest (embeddings,
  final norm, heads; tied embedding/head weights stay one parameter of the root);
- ``reshard_after_forward``: ``True`` frees each block's gathered weights after
  its forward and re-gathers them in backward (ZeRO-3); ``False`` keeps them
  until backward (ZeRO-2-like memory, one gather per step fewer);
- precision ``bf16``: ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` over fp32 sharded parameters (so the optimizer updates
  fp32 masters); ``fp32``: no policy;
- ``offload=True``: ``CPUOffloadPolicy(pin_memory=...)`` (pinned only with CUDA);
- ``compile=True`` (configs ``fsdp2-compiled``, ``fsdp2-noreshard-compiled``): each block replaced by
  ``torch.compile(block)`` before ``fully_shard``, as torchtitan does, so FSDP2's hooks stay
  outside the compiled forward, and the loss (``policy_loss``: the head's cross-entropy and the value
  term) compiled on its own, as torchtitan compiles its loss function; the root's norm and head
  projection stay eager; together the counterpart of autoshard's ``BuildOptions.compile``;
- the optimizer of ``common.torch_optimizer`` over the sharded (DTensor)
  parameters, ``clip_grad_norm_`` on them (a DTensor norm: the global norm).

The step is ``common``'s: FSDP2 reduce-scatters gradients with a mean over
the mesh, so the update equals the single-device update on the global batch.

Meta build (``FSDP2Trainer(..., meta_model=MODEL)``, torchtitan's order; what
``benchmarks/materialize_bench.py`` runs): ``MODEL`` is built on the meta device
(any policy with the reference models' ``forward`` and an ``init_rule(fqn)``: the
reference models, the ``benchmarks/hf_zoo.py`` policies); ``fully_shard`` it as
above (blocks are ``model.blocks`` or, for a Hugging Face trunk,
``model.decoder_layers``), ``to_empty(device)``, then ``init_local_shards``: each
rank fills only its own shard of each parameter, with ``autoshard.init``'s
counter-based values (``init_region`` at the shard's global offset), so the
weights equal a single-device ``init_weights(seed)`` and autoshard's sharded
initialisation; then the model's ``init_buffers()`` when it has one (a
non-persistent buffer, such as a rotary table, is garbage after ``to_empty``).
No rank ever holds a whole parameter. Not with ``offload``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.baselines.common import (
    SEED,
    BaselineError,
    RunSpec,
    local_rows,
    mean_over,
    micro_batches,
    policy_loss,
    reference_model,
    torch_optimizer,
)

try:  # public since torch 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older torch keeps it under _composable
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True, kw_only=True)
class FSDP2Options:
    """reshard_after_forward: ZeRO-3 (True) or keep gathered weights to backward (False); offload: CPU states;
    compile: ``torch.compile`` each block and the loss (module docstring)."""

    reshard_after_forward: bool = True
    offload: bool = False
    compile: bool = False


class FSDP2Trainer:
    """Data-parallel FSDP2 training of a reference policy (module docstring)."""

    def __init__(self, spec: RunSpec, device: torch.device, options: FSDP2Options = FSDP2Options(), *,
                 name: str = "fsdp2", meta_model: nn.Module | None = None, seed: int = SEED):
        """``meta_model``: shard this meta-device model and initialise its shards in place with
        ``seed`` (module docstring, "Meta build") instead of copying the reference weights."""
        if not dist.is_initialized():
            raise BaselineError("FSDP2Trainer needs an initialised process group; launch under torchrun")
        from torch.distributed.device_mesh import init_device_mesh

        self.name, self.spec, self.device = name, spec, device
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
        if meta_model is not None:
            self.model = _shard_meta(meta_model, self.mesh, spec, options, device, seed)
        else:
            model = reference_model(spec, device)  # fully_shard moves offloaded shards to the host
            self.model = _shard(model, self.mesh, spec, options)
        self.params = list(self.model.parameters())
        fused = device.type == "cuda" and not options.offload
        self.optimizer = torch_optimizer(self.params, spec.optimizer, fused=fused)
        self.loss_fn = torch.compile(policy_loss) if options.compile else policy_loss

    def step(self, global_tokens: torch.Tensor) -> float:
        """One optimizer step (``common`` module docstring, "Step")."""
        rows = local_rows(global_tokens, dist.get_world_size(), dist.get_rank()).to(self.device)
        chunks = micro_batches(rows, self.spec.num_micro_batches)
        total = torch.zeros((), device=self.device)
        for micro in chunks:
            loss = self.loss_fn(self.model(micro), micro) / len(chunks)
            loss.backward()
            total += loss.detach().float()
        self.last_grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return mean_over(total)

    def _clip(self) -> float:
        max_norm = self.spec.optimizer.max_grad_norm
        if max_norm is None:
            return float("nan")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        full = getattr(norm, "full_tensor", None)  # a DTensor over the mesh
        return float(full() if full is not None else norm)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to a full fp32 CPU tensor (collective; for tests)."""
        # a compiled block is an OptimizedModule holding the block as ``_orig_mod``: report the block's own names
        return {name.replace("._orig_mod", ""): p.full_tensor().detach().float().cpu()
                for name, p in self.model.named_parameters()}

    def close(self) -> None:
        """Drop the model and optimizer (the mesh's groups live until the process group is destroyed)."""
        del self.model, self.params, self.optimizer


def _shard(model: nn.Module, mesh, spec: RunSpec, options: FSDP2Options) -> nn.Module:
    """``fully_shard`` each block, then the root (tied weights stay in the root)."""
    kwargs = {"mesh": mesh, "reshard_after_forward": options.reshard_after_forward}
    if spec.precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if options.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = _blocks(model)
    if options.compile:
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block)
    for block in blocks:
        fully_shard(block, **kwargs)
    # The root's parameters (embedding, head) are used first and last: FSDP2 keeps the root
    # gathered from forward to backward whatever the flag says, so say so.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    return model


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: ``model.blocks`` (reference policies) or ``model.decoder_layers`` (a HF trunk's
    ``layers``, GPT-2's ``h``)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        blocks = getattr(model, "decoder_layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise BaselineError(f"{type(model).__name__}: no block list at model.blocks or model.decoder_layers to shard")
    return blocks


def _shard_meta(model: nn.Module, mesh, spec: RunSpec, options: FSDP2Options, device: torch.device,
                seed: int) -> nn.Module:
    """``fully_shard`` a meta-device model, ``to_empty`` on ``device``, initialise the shards (module docstring)."""
    if options.offload:
        raise BaselineError("FSDP2 meta build with offload: not supported; build from the reference weights")
    if any(not p.is_meta for p in model.parameters()):
        raise BaselineError("FSDP2Trainer(meta_model=...) needs a model on the meta device")
    if not callable(getattr(model, "init_rule", None)):
        raise BaselineError(f"{type(model).__name__} has no init_rule(fqn); FSDP2's meta build initialises by it")
    model = _shard(model, mesh, spec, options)
    model.to_empty(device=device)
    init_local_shards(model, seed)
    return model


@torch.no_grad()
def init_local_shards(model: nn.Module, seed: int) -> None:
    """Fill each parameter's local shard with ``model.init_rule``'s values for its global region, then buffers."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from autoshard.init import init_region, init_tensor_

    for name, param in model.named_parameters():
        fqn = name.replace("._orig_mod", "")  # a torch.compile'd block keeps the block as _orig_mod
        rule = model.init_rule(fqn)
        if not isinstance(param, DTensor):
            init_tensor_(param, rule, seed, fqn)
            continue
        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        region = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        local.copy_(init_region(rule, seed, fqn, tuple(param.shape), region, local.device))
    if callable(getattr(model, "init_buffers", None)):
        model.init_buffers()


__all__ = ["FSDP2Options", "FSDP2Trainer", "init_local_shards"]
