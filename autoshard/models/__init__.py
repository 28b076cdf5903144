"""Reference actor-critic policy models and their registry.

    from autoshard.models import build, list_models
    model = build("llama:tiny")                     # cpu, fp32, seed 0
    big = build("llama:70b")                        # on meta: shapes only
    logits, values = model(tokens)                  # [B, S, V], [B, S]

Families: ``gpt`` (GPT-2/3), ``llama`` (Llama-2, GQA), ``moe`` (Mixtral-style).
Specs are ``family:size``; ``list_models()`` (or ``autoshard models``) lists them.
"""

from autoshard.models.config import ATTN_IMPLS, GPTConfig, LlamaConfig, ModelConfig, MoEConfig
from autoshard.models.layers import KVCache
from autoshard.models.moe import MoE, Routing, expert_capacity
from autoshard.models.registry import (
    DEFAULT_SIZE,
    FAMILIES,
    ModelEntry,
    build,
    config_for,
    default_device,
    list_models,
    parse_spec,
)
from autoshard.models.transformer import GPTModel, LlamaModel, MoEModel, PolicyModel, tp_role

__all__ = [
    "ATTN_IMPLS",
    "DEFAULT_SIZE",
    "FAMILIES",
    "GPTConfig",
    "GPTModel",
    "KVCache",
    "LlamaConfig",
    "LlamaModel",
    "ModelConfig",
    "ModelEntry",
    "MoE",
    "MoEConfig",
    "MoEModel",
    "PolicyModel",
    "Routing",
    "build",
    "config_for",
    "default_device",
    "expert_capacity",
    "list_models",
    "parse_spec",
    "tp_role",
]
