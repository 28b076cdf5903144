"""An actor-critic policy on a Hugging Face ``transformers`` Llama trunk: a model autoshard did not write.

``HFLlamaPolicy(config)``: a ``transformers.LlamaModel`` trunk (``model``: embedding, decoder
layers, final RMSNorm, rotary table) + ``lm_head`` (Linear, no bias) + ``value_head`` (Linear
hidden → 1). ``forward(input_ids [B, S]) -> (logits [B, S, V], values [B, S])``, the contract of
the reference policies (``autoshard.models``), so the benchmarks' ``policy_loss`` applies as is.
Weights are random: nothing is read from a hub.

Specs (``build_hf_policy``): ``hf-llama:7b`` has Llama-2-7B's shapes (``hf_llama_7b``: hidden
4096, 32 layers, 32 heads, intermediate 11008, vocab 32000, max_position_embeddings 4096,
rms_norm_eps 1e-5, untied embeddings, ``attn_implementation="sdpa"``, ``use_cache=False``);
``hf-llama:tiny`` is a 2-layer model of the same family for CPU tests. On ``device="meta"`` the
model holds shapes only; on a real device ``init_weights(seed)`` fills it.

Initialisation (``init_rule``, HF's ``PreTrainedModel._init_weights`` for these module types):
Linear and Embedding weights N(0, initializer_range²) (0.02; HF does not scale residual
projections for Llama), RMSNorm weights 1, biases 0. Values come from ``autoshard.init``'s
counter-based generator, so a sharded build (autoshard's ``Initialize``, or FSDP2 shards
initialised in place) equals the single-device ``init_weights(seed)``. The rotary table
``model.rotary_emb.inv_freq`` is a non-persistent buffer: no parameter, in no checkpoint, and
garbage after ``to_empty``. A "meta" model therefore keeps it computed on the CPU (parameters on
meta, buffers real: what accelerate's ``init_empty_weights`` does by default), which is where
autoshard's sharded build copies buffers from (``runtime/materialize.py``: a meta buffer nobody
provides is refused); ``init_buffers`` recomputes it after ``to_empty`` (``init_weights`` calls it).

[Note: capturing a Hugging Face Llama on meta]
What ``autoshard.passes.capture`` (and so ``autoshard.compile``) needed, measured with
transformers 5.17 and torch 2.13:

1. ``LlamaModel.forward`` as HF wrote it does not capture on meta. Capture measures saved
   activations with a plain eager forward on meta tensors, and ``create_causal_mask`` →
   ``find_packed_sequence_indices`` calls ``Tensor.item()`` (``(mask[:, -1] == 0).all()``, to
   detect packed sequences; skipped only when HF sees tracing: dynamo, jit, an FX proxy or a
   ``FakeTensor``), which meta cannot answer. HF runs that check whenever ``attention_mask`` is
   ``None`` and there is no cache, and ``LlamaModel.forward`` always passes ``position_ids``
   (an ``arange`` when the caller gives none), so no argument of ``forward`` avoids it.
2. On any device, ``torch.export`` of ``LlamaModel.forward`` is "tracing" for HF, which then
   refuses to drop the causal mask (``_ignore_causal_mask_sdpa``: an exported ``is_causal``
   would be baked in) and builds a ``[B, 1, S, S]`` boolean mask in the graph: SDPA then gets
   ``attn_mask`` and a GPU cannot run the flash kernel, while the same model in eager (FSDP2)
   takes ``is_causal=True``. The two runtimes would not run the same attention.
3. What works, here, without touching capture or transformers: ``forward`` calls the trunk's
   own modules in ``LlamaModel.forward``'s order (``embed_tokens``, ``rotary_emb``, each
   ``LlamaDecoderLayer``, ``norm``) with ``attention_mask=None``, i.e. the causal,
   unpadded training case. HF's SDPA integration then passes ``is_causal=True`` and no mask,
   in eager and in the export alike (flash on GPUs; capture prices it so). Every weight-holding
   module, and the attention and MLP code, is HF's; only the six-line loop of the trunk is
   ours. No cache is made (``use_cache=False`` in the config too: the issue tracker reports
   that ``DynamicCache`` fails export; not re-tested, since this forward never creates one);
   ``attn_implementation="sdpa"`` keeps the attention one op.
4. Layers, kinds and TP roles come out of capture's heuristics without help (``model`` is a
   parameterless wrapper capture descends into): ``model.embed_tokens`` embedding,
   ``model.layers.i.{input_layernorm, self_attn, post_attention_layernorm, mlp}``,
   ``model.norm``, ``lm_head`` head, ``value_head``; ``o_proj`` and ``down_proj`` (the last
   Linear of their layer) row-parallel, the other projections column-parallel. The runtime's
   Megatron TP rewrite, though, keys off the reference models' module names
   (``TP_ROLE_RULES``): plan this model data-parallel (ZeRO-1/2/3), as the search does for 7B
   on 2 and 4 H100s.
5. Two things capture does differently here than for the reference models, both harmless:
   the rotary table is made inside ``model.rotary_emb`` (a submodule, not the root), so its
   saved cos/sin are charged to block 0's attention, whose ``class_id`` then differs from
   blocks 1..L-1 (the solver decides it apart); and the block list is ``model.layers``, not a
   child of the root, so the three-block export proxy (``passes/_capture_proxy.py``) does not
   apply and every block is exported (7B: 13 s on the 2-core CPU, ``llama:7b`` 2-5 s).
6. ``build_program`` exports a meta twin and points the graph's ``device=meta`` arguments at the
   rank's device (``passes/_graph_utils.retarget_device``). HF's rotary ``forward`` runs under
   ``@torch.no_grad()``, which export keeps as a ``wrap_with_set_grad_enabled`` subgraph;
   ``retarget_device`` had to walk into it (fixed in the runtime on 2026-11-26; before, the
   first step failed with "Tensor device mismatch! Expected: meta").
"""

from __future__ import annotations

import torch
from torch import nn

from autoshard.init import Constant, InitRule, Normal, init_tensor_

FAMILY = "hf-llama"
# Llama-2-7B's shapes (its config.json), no cache, SDPA attention.
_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
           intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096)
_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, max_position_embeddings=128)
SIZES = {"7b": _7B, "tiny": _TINY}


def _transformers():
    """The ``transformers`` package, with a one-line install hint when it is missing."""
    try:
        import transformers
    except ImportError:
        raise ImportError("the hf-llama policies need the 'transformers' package: pip install transformers") from None
    return transformers


def hf_llama_config(size: str, **overrides: object):
    """``transformers.LlamaConfig`` of ``size`` (``SIZES``), untied, SDPA, no KV cache; ``overrides`` win."""
    if size not in SIZES:
        raise ValueError(f"{FAMILY}:{size}: unknown size; allowed {sorted(SIZES)}")
    fields = dict(SIZES[size], rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa",
                  use_cache=False)
    return _transformers().LlamaConfig(**{**fields, **overrides})


def hf_llama_7b(**overrides: object):
    """Llama-2-7B's ``LlamaConfig`` (module docstring)."""
    return hf_llama_config("7b", **overrides)


def hf_llama_tiny(**overrides: object):
    """A 2-layer, hidden-64 ``LlamaConfig`` of the same family, for CPU tests."""
    return hf_llama_config("tiny", **overrides)


class HFLlamaPolicy(nn.Module):
    """``LlamaModel`` trunk + LM head + value head (module docstring)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = _transformers().LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.value_head = nn.Linear(config.hidden_size, 1)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, S] → (logits [B, S, V], values [B, S]); causal, no padding ([Note: capturing ...])."""
        trunk = self.model
        x = trunk.embed_tokens(input_ids)  # [B, S, h]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # [1, S]
        rope = trunk.rotary_emb(x, position_ids=positions)  # (cos, sin), each [1, S, head_dim]
        for layer in trunk.layers:
            x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
        x = trunk.norm(x)
        return self.lm_head(x), self.value_head(x).squeeze(-1)

    def init_rule(self, name: str) -> InitRule:
        """How parameter ``name`` is initialised (module docstring); ``autoshard.init`` draws the values."""
        if name.endswith(".bias"):
            return Constant(0.0)
        if name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, model.norm
            return Constant(1.0)
        return Normal(0.0, self.config.initializer_range)

    @torch.no_grad()
    def init_buffers(self, device: str | torch.device | None = None) -> None:
        """(Re)compute the rotary table, fp32, on ``device`` (default: where it is; the CPU when on meta)."""
        rotary = self.model.rotary_emb
        if rotary.rope_type != "default":
            raise ValueError(f"rope_type {rotary.rope_type!r}: init_buffers computes only the default RoPE table")
        if device is None:
            device = "cpu" if rotary.inv_freq.is_meta else rotary.inv_freq.device
        inv_freq, _ = rotary.compute_default_rope_parameters(self.config)  # [head_dim / 2], fp32
        rotary.inv_freq = inv_freq.to(device)
        rotary.original_inv_freq = inv_freq.to(device, copy=True)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every materialised parameter with ``init_rule`` and ``seed``, then the buffers."""
        for name, param in self.named_parameters():
            if not param.is_meta:
                init_tensor_(param, self.init_rule(name), seed, name)
        self.init_buffers()

    def tie_weights(self) -> None:
        """Nothing to tie (``tie_word_embeddings=False``); here for the reference models' build protocol."""


def is_hf_spec(spec: str) -> bool:
    """Whether ``spec`` names a policy of this module (``hf-llama:SIZE``)."""
    return spec.split(":", 1)[0] == FAMILY


def build_hf_policy(spec: str, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                    seed: int = 0, **overrides: object) -> HFLlamaPolicy:
    """``HFLlamaPolicy`` for ``spec`` (``"hf-llama:7b"``) on ``device``, initialised with ``seed`` unless meta.

    Constructed on meta (no memory, no init), parameters cast to ``dtype``. On ``"meta"`` the
    buffers (the rotary table, fp32 as HF keeps it) are computed on the CPU, as accelerate's
    ``init_empty_weights(include_buffers=False)`` leaves them: a sharded build copies buffers from
    the model and no checkpoint holds this one. On a real device the model is
    materialised with ``to_empty`` and ``init_weights(seed)``. ``overrides`` go to the config.
    """
    family, _, size = spec.partition(":")
    if family != FAMILY:
        raise ValueError(f"{spec!r}: not an {FAMILY} spec; allowed {[f'{FAMILY}:{s}' for s in SIZES]}")
    config = hf_llama_config(size, **overrides)
    with torch.device("meta"):
        model = HFLlamaPolicy(config)
    model = model.to(dtype)
    if torch.device(device).type == "meta":
        model.init_buffers("cpu")
    else:
        model = model.to_empty(device=device)
        model.init_weights(seed)
    return model


__all__ = ["FAMILY", "SIZES", "HFLlamaPolicy", "build_hf_policy", "hf_llama_7b", "hf_llama_config", "hf_llama_tiny",
           "is_hf_spec"]
