"""Capture, part 1: which modules are *layers*, their kind, parameters and shape metadata.

Layer discovery (registration order of the model's modules):

* a direct child of the root that is an ``nn.ModuleList`` / ``nn.ModuleDict`` is a
  block container: element ``i`` is block ``i`` and each child of the element is
  one layer with ``block=i`` (an element without children is itself a layer);
* any other child of the root is a layer (``block=None``), except a plain wrapper
  (kind ``other``, no parameters of its own, has children), which is searched
  recursively the same way (``transformer.h.0.attn`` style models);
* a module without any parameter (a root-level ``embed_dropout``) is never a
  layer: its nodes follow capture's nearest-preceding rule;
* a module outside every layer that owns parameters directly (a block-level
  layer-scale, a root-level positional table) becomes a layer of its own, so
  every parameter belongs to exactly one layer. Such a layer has kind ``other``
  and owns only its direct parameters (``LayerSpec.direct_only``); a root-level
  one is named ``ROOT_LAYER`` and gets no graph nodes or saved tensors of its own
  (root-level nodes follow the nearest-preceding rule of capture).

Kinds come from the module's last name component and type (see ``layer_kind``), and for a layer
that these call ``other`` from the dataflow of the exported graph (``_capture_blocks``: a
hand-written block's raw ``qkv`` / ``proj`` / ``fc`` / ``out`` projections; a width-1 critic on the
final norm's output, whatever its name, becomes ``value_head``);
the reference models' fixed names (``embed``, ``pos_embed``, ``attn_norm``,
``attn``, ``mlp_norm``, ``mlp``, ``moe``, ``norm``, ``head``, ``value_head``) all
resolve by name. A module holding 3-D parameters (stacked experts) is a ``moe``
layer, unless it has a block container child: a trunk wrapper such as Hugging
Face's ``model`` (``model.layers.i.mlp.experts``) is searched, not one layer.

Tensor-parallel roles come from ``model.tp_roles()`` when the model has it (any
alias of a tied parameter may be named), then from the dataflow for the layers
``_capture_blocks`` recognised. Otherwise, the heuristic:

* weights of ``nn.Embedding`` / ``nn.Linear`` in ``embedding`` and ``head`` layers
  whose vocabulary dimension equals the model's vocabulary → ``vocab`` (a
  positional table is ``replicate``);
* in ``attention`` and ``mlp`` layers, the *last* projection registered is the
  row-parallel one (output projection, down projection) and every other
  projection is column-parallel; a column projection's bias is ``column``, a row
  bias ``replicate``. A projection is an ``nn.Linear`` or a transformers
  ``Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``: recognised by type, see
  ``is_projection``), whose weight is stored ``[in, out]``, transposed against
  ``nn.Linear``; the role is the same, the split tensor dim is not
  (``passes/shard_parameters.py`` reads it from the op that uses the weight);
* in ``moe`` layers, 3-D parameters (stacked experts ``[E, ...]``) → ``expert``;
* everything else (norms, routers, value head) → ``replicate``.

Tied parameters (``head.weight is embed.weight``) are owned by the first layer in
execution order that holds them and are listed by the later ones in
``LayerInfo.tied_params``, so parameter counts add up to the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autoshard.errors import CaptureError
from autoshard.graph import TP_ROLES, ParamInfo

ROOT_LAYER = "<root>"

_HEAD_NAMES = ("head", "lm_head", "output")
_MLP_NAMES = ("mlp", "ffn", "feed_forward", "feedforward")
_MOE_NAMES = ("moe", "experts", "sparse_moe", "block_sparse_moe")
_HEADS_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads")
_KV_HEADS_ATTRS = ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "n_kv_head")
_EXPERTS_ATTRS = ("num_experts", "n_experts", "n_routed_experts", "num_local_experts")
_TOPK_ATTRS = ("top_k", "topk", "num_experts_per_tok", "n_experts_per_tok")
_FFN_ATTRS = ("ffn_hidden", "ffn_hidden_size", "intermediate_size", "ffn_dim", "ffn")


def is_projection(module: nn.Module) -> bool:
    """``nn.Linear``, or a transformers ``Conv1D``: a linear map whose weight is ``[in, out]``
    (by type name and its ``nx``/``nf`` attributes: capture does not import transformers)."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def out_features(module: nn.Module) -> int:
    """Output width of a projection (``is_projection``)."""
    return module.out_features if isinstance(module, nn.Linear) else module.nf


@dataclass(frozen=True)
class LayerSpec:
    """A layer module found in the model (internal to capture: holds the live module)."""

    name: str
    kind: str
    block: int | None
    module: nn.Module
    direct_only: bool = False  # owns only module.parameters(recurse=False)

    def own_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(local name, parameter) pairs this layer owns, tied duplicates removed."""
        return list(self.module.named_parameters(recurse=not self.direct_only, remove_duplicate=True))


def layer_kind(name: str, module: nn.Module) -> str:
    """Kind of a layer module, from its last name component and its type."""
    leaf = name.rsplit(".", 1)[-1].lower()
    if leaf == "value_head":
        return "value_head"
    if leaf in _HEAD_NAMES:
        return "head"
    if isinstance(module, nn.Embedding) or "embed" in leaf or leaf in ("wte", "wpe"):
        return "embedding"
    if "norm" in leaf or leaf.startswith("ln") or isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return "norm"
    if leaf in _MOE_NAMES or (any(p.dim() == 3 for p in module.parameters()) and not _holds_blocks(module)):
        return "moe"
    if "attn" in leaf or "attention" in leaf:
        return "attention"
    if leaf in _MLP_NAMES:
        return "mlp"
    return "other"


def _holds_blocks(module: nn.Module) -> bool:
    """Whether ``module`` has a block container child: a trunk (``model.layers``), never one layer."""
    return any(isinstance(child, (nn.ModuleList, nn.ModuleDict)) for child in module.children())


def find_layers(model: nn.Module) -> list[LayerSpec]:
    """Every layer module of ``model`` in registration order (rules in the module docstring)."""
    layers: list[LayerSpec] = []
    _collect(model, "", layers)
    covered = {id(m) for spec in layers for m in spec.module.modules()}
    for name, module in model.named_modules():
        if id(module) in covered or not any(True for _ in module.parameters(recurse=False)):
            continue
        layers.append(LayerSpec(name or ROOT_LAYER, "other", _block_of(name, layers), module, direct_only=True))
    if not layers:
        raise CaptureError(
            f"model {type(model).__name__} has no submodules to treat as layers; "
            "autoshard needs a model built from modules (embed, blocks.i.*, norm, head, ...)"
        )
    return layers


def _collect(parent: nn.Module, prefix: str, out: list[LayerSpec]) -> None:
    for child_name, child in parent.named_children():
        path = f"{prefix}{child_name}"
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for position, (key, block) in enumerate(child.named_children()):
                index = int(key) if key.isdigit() else position
                members = list(block.named_children()) or [("", block)]
                for member_name, member in members:
                    name = f"{path}.{key}.{member_name}" if member_name else f"{path}.{key}"
                    if _has_params(member):
                        out.append(LayerSpec(name, layer_kind(name, member), index, member))
            continue
        if not _has_params(child):
            continue
        kind = layer_kind(path, child)
        has_own_params = any(True for _ in child.parameters(recurse=False))
        if kind == "other" and not has_own_params and any(True for _ in child.children()):
            _collect(child, f"{path}.", out)
        else:
            out.append(LayerSpec(path, kind, None, child))


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _block_of(name: str, layers: list[LayerSpec]) -> int | None:
    """Block index of a leftover module that sits inside a block container."""
    for spec in layers:
        if spec.block is not None and name and spec.name.startswith(name + "."):
            return spec.block
    return None


def param_roles(model: nn.Module, layers: list[LayerSpec], vocab: int,
                inferred: dict[int, str] | None = None) -> dict[int, str]:
    """``id(parameter)`` → tp role, from ``model.tp_roles()``, else ``inferred`` (the roles the exported
    graph's dataflow gives the layers it recognised: ``_capture_blocks``), else the documented heuristic."""
    roles: dict[int, str] = {}
    for spec in layers:
        roles.update(_heuristic_roles(spec, vocab))
    roles.update(inferred or {})
    declared = model.tp_roles() if callable(getattr(model, "tp_roles", None)) else {}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    for fqn, role in declared.items():
        if role not in TP_ROLES:
            raise CaptureError(
                f"model.tp_roles() gives role {role!r} for {fqn!r}; allowed roles: {TP_ROLES}; "
                "fix tp_roles() or drop the entry to use the heuristic"
            )
        if fqn not in by_name:
            raise CaptureError(
                f"model.tp_roles() names {fqn!r}, which is not a parameter of the model; "
                "use fully-qualified names from model.named_parameters()"
            )
        roles[id(by_name[fqn])] = role
    return roles


def _heuristic_roles(spec: LayerSpec, vocab: int) -> dict[int, str]:
    roles = {id(p): "replicate" for _, p in spec.own_parameters()}
    if spec.direct_only:
        return roles
    if spec.kind in ("embedding", "head"):
        for module in spec.module.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)) and _vocab_of(module) == vocab:
                roles[id(module.weight)] = "vocab"
    elif spec.kind in ("attention", "mlp"):
        linears = [m for m in spec.module.modules() if is_projection(m)]
        for position, linear in enumerate(linears):
            row = position == len(linears) - 1 and len(linears) > 1
            roles[id(linear.weight)] = "row" if row else "column"
            if linear.bias is not None:
                roles[id(linear.bias)] = "replicate" if row else "column"
    elif spec.kind == "moe":
        for p in spec.module.parameters():
            if p.dim() == 3:
                roles[id(p)] = "expert"
    return roles


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def layer_params(
    ordered: list[LayerSpec], roles: dict[int, str]
) -> dict[str, tuple[tuple[ParamInfo, ...], tuple[str, ...]]]:
    """Layer name → (owned ``ParamInfo``s, fqns of tied parameters owned by an earlier layer).

    ``ordered`` must be in execution order: the first layer holding a tied
    parameter owns it.
    """
    owner: dict[int, str] = {}
    out: dict[str, tuple[tuple[ParamInfo, ...], tuple[str, ...]]] = {}
    for spec in ordered:
        owned: list[ParamInfo] = []
        tied: list[str] = []
        prefix = "" if spec.name == ROOT_LAYER else f"{spec.name}."
        for local, p in spec.own_parameters():
            if id(p) in owner:
                tied.append(f"{prefix}{local}")
                continue
            owner[id(p)] = spec.name
            info = ParamInfo(f"{prefix}{local}", tuple(p.shape), dtype_name(p.dtype), roles[id(p)])
            owned.append(info)
        out[spec.name] = (tuple(owned), tuple(tied))
    return out


def module_weight_roles(layers: list[LayerSpec], roles: dict[int, str]) -> dict[int, str]:
    """``id(module)`` → role of its direct ``weight`` parameter, for modules that have one."""
    out: dict[int, str] = {}
    for spec in layers:
        for module in spec.module.modules():
            weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
            if weight is not None:
                out[id(module)] = roles[id(weight)]
    return out


def _first_attr(objects: tuple[object, ...], names: tuple[str, ...]) -> int | None:
    for obj in objects:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def model_hidden_vocab(model: nn.Module, layers: list[LayerSpec]) -> tuple[int, int]:
    """(hidden size, vocabulary size) of the model, from its embedding or ``config``."""
    config = getattr(model, "config", None)
    hidden = _first_attr((config,), ("hidden", "hidden_size", "d_model", "n_embd", "dim"))
    vocab = _first_attr((config,), ("vocab_size", "vocab", "n_vocab"))
    for spec in layers:
        for module in spec.module.modules():
            if isinstance(module, nn.Embedding) and spec.kind == "embedding":
                hidden = hidden or module.embedding_dim
                vocab = vocab or module.num_embeddings
                break
    return hidden or 0, vocab or 0


def shape_meta(spec: LayerSpec, model: nn.Module, hidden: int, vocab: int) -> dict[str, int | None]:
    """Shape metadata of one layer: heads, kv heads, hidden, ffn width, experts, top-k, vocab.

    Read from attributes of the layer module first, then ``model.config``;
    the FFN width of an MLP falls back to the first linear's output features.
    """
    sources = (spec.module, getattr(model, "config", None))
    meta: dict[str, int | None] = {"hidden": hidden or None}
    if spec.kind == "attention":
        heads = _first_attr(sources, _HEADS_ATTRS)
        meta["num_heads"] = heads
        meta["num_kv_heads"] = _first_attr(sources, _KV_HEADS_ATTRS) or heads
    elif spec.kind == "mlp":
        linears = [m for m in spec.module.modules() if is_projection(m)]
        first_out = out_features(linears[0]) if linears else None
        meta["ffn_hidden"] = _first_attr((spec.module,), _FFN_ATTRS) or first_out
    elif spec.kind == "moe":
        stacked = [p for p in spec.module.parameters() if p.dim() == 3]
        experts = _first_attr(sources, _EXPERTS_ATTRS) or (stacked[0].shape[0] if stacked else None)
        meta["num_experts"] = experts
        meta["top_k"] = _first_attr(sources, _TOPK_ATTRS)
        # the smallest non-hidden width: f, also when gate and up are fused ([E, 2f, h] next to [E, h, f])
        widths = [d for p in stacked for d in p.shape[1:] if d != hidden]
        meta["ffn_hidden"] = _first_attr((spec.module,), _FFN_ATTRS) or min(widths, default=None)
    elif spec.kind in ("embedding", "head") and _vocab_of(spec.module) == vocab:
        meta["vocab"] = vocab
    return meta


def _vocab_of(module: nn.Module) -> int | None:
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
        if isinstance(m, nn.Linear):
            return m.out_features
    return None
