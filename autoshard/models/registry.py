"""Named reference models: ``family:size`` specs, their shapes, and ``build``.

Shapes and where they come from:

gpt (vocab 50257, GELU MLP 4h, tied embeddings; seq 1024, 2048 from 7b up):
    125m, 350m, 1.3b, 7b, 13b are GPT-3 Small / Medium / XL / 6.7B / 13B
    (Brown et al. 2020, Table 2.1). XL uses 16 heads of 128 (the table's "24
    heads" does not divide 2048; Megatron uses 16), 13B uses h = 5120 (the
    table's 5140 is not divisible by its 40 heads). GPT-3 has no 70B: ``70b``
    is the Chinchilla / Llama-65B trunk shape (80 layers, h 8192, 64 heads),
    about 65e9 parameters with the GPT vocabulary.
llama (vocab 32000, untied, RoPE θ 10⁴):
    7b, 13b, 70b are Llama-2 (Touvron et al. 2023): seq 4096, ffn 11008 /
    13824 / 28672, 70b with GQA of 8 kv heads. 125m, 350m, 1.3b reuse the
    GPT-3 trunk shapes (L, h, a) with the Llama FFN rule (8h/3 rounded up to
    256: 2048, 2816, 5632) and seq 2048.
moe:
    8x7b is Mixtral-8x7B (Jiang et al. 2024): 32 layers, h 4096, 32 heads, 8
    kv heads, expert ffn 14336, 8 experts, top-2, vocab 32000, seq 32768,
    RoPE θ 10⁶, dropless.
tiny (every family): 2 layers, h 64, 4 heads, vocab 128, seq 128; llama and
    moe use 2 kv heads (so GQA is exercised), moe 4 experts top-2.

Sizes from 1.3b up build on ``meta`` unless a device is passed (7b in fp32 is
27 GB); smaller ones build on ``cpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autoshard.errors import ModelError
from autoshard.models.config import GPTConfig, LlamaConfig, MoEConfig
from autoshard.models.transformer import GPTModel, LlamaModel, MoEModel, PolicyModel

DEFAULT_SIZE = "tiny"
_EAGER_SIZES = ("tiny", "125m", "350m")  # built on cpu by default; others on meta
_TINY = dict(vocab_size=128, max_seq_len=128, hidden=64, num_layers=2, num_heads=4)
_LLAMA2 = dict(vocab_size=32000, max_seq_len=4096)
_LLAMA_SMALL = dict(vocab_size=32000, max_seq_len=2048)
_GPT_SHORT = dict(vocab_size=50257, max_seq_len=1024)
_GPT_LONG = dict(vocab_size=50257, max_seq_len=2048)


@dataclass(frozen=True)
class _Family:
    config_cls: type
    model_cls: type[PolicyModel]
    sizes: dict[str, tuple[dict, str]]  # size → (config fields, description)


FAMILIES: dict[str, _Family] = {
    "gpt": _Family(
        GPTConfig,
        GPTModel,
        {
            "tiny": (_TINY, "CI model: 2 layers, h 64"),
            "125m": (dict(_GPT_SHORT, hidden=768, num_layers=12, num_heads=12), "GPT-3 Small"),
            "350m": (dict(_GPT_SHORT, hidden=1024, num_layers=24, num_heads=16), "GPT-3 Medium"),
            "1.3b": (dict(_GPT_SHORT, hidden=2048, num_layers=24, num_heads=16), "GPT-3 XL"),
            "7b": (dict(_GPT_LONG, hidden=4096, num_layers=32, num_heads=32), "GPT-3 6.7B"),
            "13b": (dict(_GPT_LONG, hidden=5120, num_layers=40, num_heads=40), "GPT-3 13B"),
            "70b": (dict(_GPT_LONG, hidden=8192, num_layers=80, num_heads=64), "Chinchilla-70B trunk shape (~65B)"),
        },
    ),
    "llama": _Family(
        LlamaConfig,
        LlamaModel,
        {
            "tiny": (dict(_TINY, num_kv_heads=2, ffn_hidden=128), "CI model: 2 layers, h 64, GQA 4/2"),
            "125m": (
                dict(_LLAMA_SMALL, hidden=768, num_layers=12, num_heads=12, ffn_hidden=2048),
                "GPT-3 Small trunk, SwiGLU",
            ),
            "350m": (
                dict(_LLAMA_SMALL, hidden=1024, num_layers=24, num_heads=16, ffn_hidden=2816),
                "GPT-3 Medium trunk, SwiGLU",
            ),
            "1.3b": (
                dict(_LLAMA_SMALL, hidden=2048, num_layers=24, num_heads=16, ffn_hidden=5632),
                "GPT-3 XL trunk, SwiGLU",
            ),
            "7b": (dict(_LLAMA2, hidden=4096, num_layers=32, num_heads=32, ffn_hidden=11008), "Llama-2 7B"),
            "13b": (dict(_LLAMA2, hidden=5120, num_layers=40, num_heads=40, ffn_hidden=13824), "Llama-2 13B"),
            "70b": (
                dict(_LLAMA2, hidden=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_hidden=28672),
                "Llama-2 70B (GQA, 8 kv heads)",
            ),
        },
    ),
    "moe": _Family(
        MoEConfig,
        MoEModel,
        {
            "tiny": (dict(_TINY, num_kv_heads=2, ffn_hidden=128, num_experts=4, top_k=2), "CI model: 4 experts, top-2"),
            "8x7b": (
                dict(
                    vocab_size=32000, max_seq_len=32768, hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    ffn_hidden=14336, num_experts=8, top_k=2, rope_theta=1e6,
                ),
                "Mixtral-8x7B",
            ),
        },
    ),
}


@dataclass(frozen=True)
class ModelEntry:
    """One named model: ``family:size``, its parameter count and a one-line description."""

    family: str
    size: str
    params: int
    description: str

    @property
    def spec(self) -> str:
        return f"{self.family}:{self.size}"


def parse_spec(spec: str) -> tuple[str, str]:
    """``"family:size"`` → (family, size); the size defaults to ``"tiny"``. Unknown names raise ``ModelError``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelError(f"model spec {spec!r} is empty; write family:size, e.g. llama:7b; see `autoshard models`")
    family, _, size = spec.strip().lower().partition(":")
    size = size or DEFAULT_SIZE
    if family not in FAMILIES:
        raise ModelError(
            f"unknown model family {family!r} in spec {spec!r}; allowed: {', '.join(FAMILIES)}; see `autoshard models`"
        )
    sizes = FAMILIES[family].sizes
    if size not in sizes:
        raise ModelError(
            f"unknown size {size!r} for model family {family!r}; allowed: {', '.join(sizes)}; see `autoshard models`"
        )
    return family, size


def config_for(spec: str, **overrides: object) -> GPTConfig | LlamaConfig | MoEConfig:
    """The config of ``spec`` with ``overrides`` replacing fields; bad names or values raise ``ModelError``."""
    family, size = parse_spec(spec)
    fields, _ = FAMILIES[family].sizes[size]
    return FAMILIES[family].config_cls.from_fields({**fields, **overrides})


def list_models() -> list[ModelEntry]:
    """Every named model, family by family, with its exact parameter count."""
    return [
        ModelEntry(family, size, config_for(f"{family}:{size}").param_count(), description)
        for family, fam in FAMILIES.items()
        for size, (_, description) in fam.sizes.items()
    ]


def default_device(spec: str) -> torch.device:
    """``cpu`` for sizes below 1.3b, ``meta`` for the rest."""
    return torch.device("cpu" if parse_spec(spec)[1] in _EAGER_SIZES else "meta")


def build(
    spec: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    **overrides: object,
) -> nn.Module:
    """Build the policy model ``spec`` (``"family:size"``) with config ``overrides``.

    The model is constructed on ``meta``, cast to ``dtype`` (default: fp32),
    materialised on ``device`` (default: ``default_device(spec)``) and
    initialised by ``init_weights(seed)``; on ``meta`` it stays uninitialised
    (call ``to_empty``, ``tie_weights`` and ``init_weights`` later, or hand it to
    ``autoshard.compile``, which initialises each rank's shards alone).
    """
    config = config_for(spec, **overrides)
    target = torch.device(device) if device is not None else default_device(spec)
    with torch.device("meta"):
        model = FAMILIES[parse_spec(spec)[0]].model_cls(config)
    if dtype is not None:
        model = model.to(dtype)
    if target.type != "meta":
        model = model.to_empty(device=target)
        model.tie_weights()
        model.init_weights(seed)
    return model
