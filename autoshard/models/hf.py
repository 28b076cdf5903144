"""Actor-critic policies on Hugging Face ``transformers`` trunks, as users bring them.

``actor_critic(config)`` wraps a causal LM's config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``,
``Qwen3Config``, ``GemmaConfig``, ``MixtralConfig``, ``PhiConfig``, ``GPT2Config``; ``load_hf_config(path)``
reads one from a directory with ``config.json`` or from the file) into the policy autoshard plans and trains: the
``transformers`` trunk (``model``: embedding, decoder layers, final norm, rotary table or position
embedding) + ``lm_head`` (Linear hidden → vocab, tied to the embedding when the config ties them) +
``value_head`` (Linear hidden → 1), with the reference policies' contract
``forward(input_ids [B, S]) -> (logits [B, S, V], values [B, S])``. ``from_causal_lm(hf_model)`` wraps
a model the user already has (``LlamaForCausalLM.from_pretrained(local_dir)``, ...): its own trunk and
``lm_head``, weights and ties as they are, plus a seeded value head. Built on meta it costs nothing
(planning reads no weights); its buffers (rotary tables, Gemma's embedding scale) are computed on
the CPU. The CLI takes such a directory or file as ``MODEL`` (``autoshard/models/source.py``).

What this covers and what not (yet): ``forward(input_ids, attention_mask=None, position_ids=None)``:
padding (left or right, ``attention_mask``) and packed rows (``position_ids`` restarting per document)
as HF's training masks treat them (``causal_mask``); it calls the trunk's own modules in a loop of its
own (why, and what capture needed: ``benchmarks/hf_zoo.py``, note "capturing a Hugging Face trunk on
meta"). Data-parallel plans (DDP, ZeRO-1/2/3, HSDP, offload) train like plain PyTorch on gloo.
Megatron tensor parallelism (``tp="megatron"``, with or without ``sp``, alone or with ZeRO) trains
like plain PyTorch on gloo for Llama, Qwen2, Qwen3, Gemma, Phi, Mixtral's attention and GPT-2
(``tests/test_hf_tensor_parallel.py``): nothing here is model-specific, the passes read the
trunks' own graphs — grouped-query attention's head counts (``repeat_kv`` or SDPA's
``enable_gqa``), GPT-2's ``Conv1D`` (a weight stored ``[in, out]``) and its fused ``c_attn``
(each rank holds its q, k and v heads: ``passes/context.py``, fused projections), Phi's LM-head
bias, Gemma's padding row (``passes/insert_collectives.py``). tp must divide the attention and
key/value heads, the MLP width and the vocabulary (``search/space.py``, ``tp_divides``): an MQA
trunk (one key/value head) or GPT-2's 50257-token vocabulary gets no tp, and a forced plan is
refused (``PlanError``) while the program is built. Mixtral's experts stay unsplit over tp, a model
with MoE layers trains without ``sp``, and expert parallelism is refused at plan time (its experts
run as ``_grouped_mm``: ``LayerInfo.ep_refusal``). Checkpoints of a tp plan of GPT-2 save its
fused ``c_attn`` as one DCP chunk per part's block, under the global tensor's key, so they resume under any
plan (``runtime/checkpoint.py``, ``tests/test_checkpoint_fused_tp.py``). Pipeline parallelism
(pp > 1, with ZeRO-1/2/3 or tp) trains like plain PyTorch for Llama, Qwen2, Mixtral and GPT-2, whose tied ``wte``/``lm_head`` is mirrored between pp ranks
(``tests/test_pipeline_user_models.py``); the search prices no such mirror and keeps a tied model at
pp = 1 (``tied/pp``). Weights come from
``autoshard.runtime.materialize`` sources (``Safetensors``, ``Initialize`` with ``init_rule``:
HF's rules by module type).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from torch import nn

from autoshard.errors import ModelError
from autoshard.init import Constant, InitRule, Normal, init_tensor_

def _transformers():
    """The ``transformers`` package, with a one-line install hint when it is missing."""
    try:
        import transformers
    except ImportError:
        raise ImportError("the hf-* policies need the 'transformers' package: pip install transformers") from None
    return transformers


# --------------------------------------------------------------------------- policies


class HFPolicy(nn.Module):
    """A ``transformers`` trunk + LM head + value head (module docstring); subclasses write ``_trunk``."""

    trunk_class = ""  # the transformers class of ``model``
    lm_head_bias = False
    norm_weight = 1.0  # HF's init of LayerNorm / RMSNorm weights

    def __init__(self, config, *, trunk: nn.Module | None = None, lm_head: nn.Linear | None = None) -> None:
        """A new trunk and heads from ``config``, or an existing model's ``trunk`` and ``lm_head``
        (``from_causal_lm``), which keep their weights and ties."""
        super().__init__()
        self.config = config
        self.model = trunk if trunk is not None else getattr(_transformers(), self.trunk_class)(config)
        self.lm_head = lm_head if lm_head is not None else nn.Linear(config.hidden_size, config.vocab_size,
                                                                     bias=self.lm_head_bias)
        self.value_head = nn.Linear(config.hidden_size, 1)
        if lm_head is None:
            self.tie_weights()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, S] (+ attention_mask [B, S], 1 = token; position_ids [B or 1, S]) → (logits [B, S, V],
        values [B, S]); the mask rule is ``causal_mask``'s."""
        x = self._trunk(input_ids, attention_mask, position_ids)  # [B, S, h], after the final norm
        return self.lm_head(x), self.value_head(x).squeeze(-1)

    def _trunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The trunk's repeated blocks (FSDP2 shards one unit per block)."""
        return self.model.layers

    def tie_weights(self) -> None:
        """Point ``lm_head.weight`` at the input embedding when the config ties them (again after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.get_input_embeddings().weight

    def init_rule(self, name: str) -> InitRule:
        """How parameter ``name`` is initialised: by its module's type, as HF's ``_init_weights`` (module docstring)."""
        module_name, _, leaf = name.rpartition(".")
        module = self.get_submodule(module_name)
        kind = type(module).__name__
        if leaf == "bias":
            return Constant(0.0)
        if "LayerNorm" in kind or "RMSNorm" in kind:
            return Constant(self.norm_weight)
        if isinstance(module, (nn.Linear, nn.Embedding)) or kind in ("Conv1D", "MixtralExperts", "MixtralTopKRouter"):
            return Normal(0.0, self._weight_std(module_name))
        raise ValueError(f"parameter {name!r} of a {kind}: no init rule; allowed modules: Linear, Embedding, "
                         "Conv1D, Mixtral experts and router, LayerNorm, RMSNorm (add the module's HF rule)")

    def _weight_std(self, module_name: str) -> float:
        del module_name  # GPT-2 scales its residual projections
        return self.config.initializer_range

    @torch.no_grad()
    def init_buffers(self, device: str | torch.device | None = None) -> None:
        """(Re)compute the rotary tables and Gemma's embedding scale, fp32, on ``device`` (default: where each
        buffer is; the CPU when it is on meta). Any other buffer left on meta is refused."""
        for name, module in self.named_modules():
            where = device
            if hasattr(module, "original_inv_freq"):  # every HF RotaryEmbedding
                where = where or ("cpu" if module.inv_freq.is_meta else module.inv_freq.device)
                if module.rope_type == "default":
                    init_fn = module.compute_default_rope_parameters
                else:  # llama3, linear, yarn, ...: HF's own table for the type, as the module's __init__ picks it
                    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                    if module.rope_type not in ROPE_INIT_FUNCTIONS:
                        raise ValueError(f"{name}: rope_type {module.rope_type!r} is not one transformers "
                                         f"computes ({', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
                    init_fn = ROPE_INIT_FUNCTIONS[module.rope_type]
                inv_freq, module.attention_scaling = init_fn(module.config)  # [rotary_dim / 2], fp32; device: the CPU
                module.inv_freq = inv_freq.to(where)
                module.original_inv_freq = inv_freq.to(where, copy=True)
            elif hasattr(module, "scalar_embed_scale"):  # GemmaTextScaledWordEmbedding: sqrt(hidden)
                where = where or ("cpu" if module.embed_scale.is_meta else module.embed_scale.device)
                module.embed_scale = torch.tensor(module.scalar_embed_scale, device=where)
        left = [name for name, buf in self.named_buffers() if buf.is_meta]
        if left:
            raise ValueError(f"buffers {left} have no values: init_buffers knows only rotary tables and Gemma's "
                             "embed_scale")

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every materialised parameter with ``init_rule`` and ``seed``, then the buffers."""
        for name, param in self.named_parameters():
            if not param.is_meta:
                init_tensor_(param, self.init_rule(name), seed, name)
        self.init_buffers()


class RotaryPolicy(HFPolicy):
    """Rotary trunks: ``embed_tokens``, ``rotary_emb``, ``layers``, then the final norm ``final_norm``
    (Llama, Qwen2, Gemma, Mixtral: ``norm``; Phi overrides the embedding and the norm's name)."""

    final_norm = "norm"

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [B, S, h]; Gemma's module multiplies by sqrt(h) itself

    def _trunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        trunk = self.model
        x = self._embed(input_ids)
        mask = causal_mask(x, attention_mask, position_ids)  # [B, 1, S, S] bool, or None: SDPA's is_causal
        positions = _positions(input_ids, position_ids)  # [B or 1, S]
        rope = trunk.rotary_emb(x, position_ids=positions)  # (cos, sin), each [B or 1, S, rotary dims]
        for layer in trunk.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        return getattr(trunk, self.final_norm)(x)


class HFLlamaPolicy(RotaryPolicy):
    """``LlamaModel`` trunk (module docstring)."""

    trunk_class = "LlamaModel"


class HFQwen2Policy(RotaryPolicy):
    """``Qwen2Model`` trunk (module docstring)."""

    trunk_class = "Qwen2Model"


class HFMistralPolicy(RotaryPolicy):
    """``MistralModel`` trunk (module docstring)."""

    trunk_class = "MistralModel"


class HFQwen3Policy(RotaryPolicy):
    """``Qwen3Model`` trunk: per-head RMSNorms on q and k (``q_norm``, ``k_norm``; module docstring)."""

    trunk_class = "Qwen3Model"


class HFGemmaPolicy(RotaryPolicy):
    """``GemmaModel`` trunk; its RMSNorm weights start at 0 (module docstring)."""

    trunk_class = "GemmaModel"
    norm_weight = 0.0


class HFMixtralPolicy(RotaryPolicy):
    """``MixtralModel`` trunk with the ``grouped_mm`` experts implementation (module docstring)."""

    trunk_class = "MixtralModel"


class HFPhiPolicy(RotaryPolicy):
    """``PhiModel`` trunk: ``embed_dropout`` after the embedding, ``final_layernorm``; ``lm_head`` has a bias."""

    trunk_class = "PhiModel"
    lm_head_bias = True
    final_norm = "final_layernorm"

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_dropout(self.model.embed_tokens(input_ids))


class HFGPT2Policy(HFPolicy):
    """``GPT2Model`` trunk: token + learned position embeddings, ``h`` blocks, ``ln_f`` (module docstring)."""

    trunk_class = "GPT2Model"

    def _trunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        trunk = self.model
        x = trunk.wte(input_ids)  # [B, S, h]
        mask = causal_mask(x, attention_mask, position_ids)  # [B, 1, S, S] bool, or None: SDPA's is_causal
        x = trunk.drop(x + trunk.wpe(_positions(input_ids, position_ids)))
        for block in trunk.h:
            x = block(x, attention_mask=mask)
        return trunk.ln_f(x)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """GPT-2's blocks (``model.h``)."""
        return self.model.h

    def _weight_std(self, module_name: str) -> float:
        if module_name.endswith(".c_proj"):  # attn.c_proj and mlp.c_proj: HF's GPT-2 residual scaling
            return self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
        return self.config.initializer_range



def causal_mask(x: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean [B, 1, S, S] SDPA mask (True = attend), as HF's ``create_causal_mask`` builds it for training:
    causal, and the key is a token (``attention_mask`` [B, S], 1 = token); without ``attention_mask``,
    ``position_ids`` that do not step by 1 start a packed document: causal within a document. ``None``
    (SDPA's ``is_causal``) when neither is given. Tensor ops only, no data-dependent branch: it
    captures on meta and exports (HF's own mask code calls ``.item()``)."""
    if attention_mask is None and position_ids is None:
        return None
    idx = torch.arange(x.shape[1], device=x.device)
    mask = (idx[None, :] <= idx[:, None])[None, None]  # [1, 1, S, S]: key j <= query i
    if attention_mask is not None:
        return mask & attention_mask.bool()[:, None, None, :]
    positions = position_ids.expand(x.shape[0], -1)  # [B, S] ([1, S] broadcast)
    doc = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)  # [B, S] document index
    return mask & (doc[:, None, :, None] == doc[:, None, None, :])


def _positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """``position_ids``, or 0 … S−1 shared by every row ([1, S])."""
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)


POLICIES: dict[str, type[HFPolicy]] = {
    "llama": HFLlamaPolicy, "mistral": HFMistralPolicy, "qwen2": HFQwen2Policy, "qwen3": HFQwen3Policy,
    "gemma": HFGemmaPolicy, "mixtral": HFMixtralPolicy,
    "phi": HFPhiPolicy, "gpt2": HFGPT2Policy,
}
# what every policy's config needs (benchmarks/hf_zoo.py, note "capturing a Hugging Face trunk on meta")
TRAINING_FIELDS = dict(attn_implementation="sdpa", use_cache=False)


def load_hf_config(path: str | Path):
    """The ``transformers`` config in ``path``: a directory holding ``config.json`` (as ``save_pretrained``
    writes it) or a JSON file. ``ModelError`` when it is neither or ``transformers`` cannot read it."""
    path = Path(path).expanduser()
    source = path if path.is_dir() else path.parent
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(f"{str(path)!r} has no config.json: a Hugging Face model directory holds one")
    if not path.exists():
        raise ModelError(f"no Hugging Face config at {str(path)!r}")
    transformers = _transformers()
    try:
        if path.is_dir():
            return transformers.AutoConfig.from_pretrained(str(source))
        import json

        data = json.loads(path.read_text())
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ModelError(f"{str(path)!r} has no model_type: not a Hugging Face config")
        return transformers.AutoConfig.for_model(model_type, **data)
    except ModelError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers' own reasons, in one line
        raise ModelError(f"transformers cannot read the config at {str(path)!r}: {type(err).__name__}: {err}") from err


def _policy_class(config, what: str) -> type[HFPolicy]:
    """The policy class of ``config.model_type``; ``ModelError`` naming the supported ones."""
    policy_class = POLICIES.get(getattr(config, "model_type", None))
    if policy_class is None:
        raise ModelError(f"{what} model_type {getattr(config, 'model_type', None)!r} has no actor-critic policy "
                         f"here; supported: {', '.join(sorted(POLICIES))}")
    return policy_class


def _for_training(config):
    """``config`` with ``TRAINING_FIELDS`` set (in place; returned)."""
    config.use_cache = TRAINING_FIELDS["use_cache"]
    config._attn_implementation = TRAINING_FIELDS["attn_implementation"]
    return config


def actor_critic(config, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> HFPolicy:
    """The policy of a ``transformers`` causal-LM ``config`` (module docstring) on ``device`` in ``dtype``.

    On meta: nothing allocated, buffers computed on the CPU. On a real device: materialised and
    initialised with HF's rules (``init_weights(seed)``). The config is copied with
    ``TRAINING_FIELDS`` (SDPA attention, no KV cache)."""
    policy_class = _policy_class(config, "Hugging Face")
    config = _for_training(copy.deepcopy(config))  # not via to_dict: private choices (Mixtral's experts) stay
    with torch.device("meta"):
        model = policy_class(config)
    model = model.to(dtype)
    if torch.device(device).type == "meta":
        model.init_buffers("cpu")
    else:
        model = model.to_empty(device=device)
        model.tie_weights()
        model.init_weights(seed)
    return model


def from_causal_lm(hf_model: nn.Module, *, seed: int = 0) -> HFPolicy:
    """An actor-critic over an existing ``transformers`` causal LM (``LlamaForCausalLM``, ``GPT2LMHeadModel``,
    ..., e.g. from ``from_pretrained`` of a local directory): its trunk and ``lm_head`` are used as they
    are (same parameters, same ties), and a new ``value_head`` (HF's normal init with ``seed``, bias 0)
    is added on the model's device and dtype. The model's config is switched to SDPA attention and no
    KV cache (``TRAINING_FIELDS``): its attention modules read it at every call."""
    config = getattr(hf_model, "config", None)
    policy_class = _policy_class(config, type(hf_model).__name__ + ":")
    trunk = getattr(hf_model, "transformer" if config.model_type == "gpt2" else "model", None)
    lm_head = getattr(hf_model, "lm_head", None)
    if trunk is None or not isinstance(lm_head, nn.Linear):
        raise ModelError(f"{type(hf_model).__name__}: expected a causal LM with a trunk "
                         f"({'transformer' if config.model_type == 'gpt2' else 'model'}) and an lm_head Linear; "
                         "pass the *ForCausalLM / *LMHeadModel class")
    policy = policy_class(_for_training(config), trunk=trunk, lm_head=lm_head)
    weight = lm_head.weight
    policy.value_head.to(device=weight.device, dtype=weight.dtype)
    if not weight.is_meta:
        with torch.no_grad():
            for name, param in policy.value_head.named_parameters(prefix="value_head"):
                init_tensor_(param, policy.init_rule(name), seed, name)
    return policy


__all__ = ["HFGPT2Policy", "HFGemmaPolicy", "HFLlamaPolicy", "HFMixtralPolicy", "HFPhiPolicy", "HFPolicy",
           "HFQwen2Policy", "POLICIES", "RotaryPolicy", "TRAINING_FIELDS", "actor_critic", "from_causal_lm", "load_hf_config"]
