"""A zoo of actor-critic policies on Hugging Face ``transformers`` trunks: models autoshard did not write.

Each policy is a ``transformers`` trunk (``model``: embedding, decoder layers, final norm, rotary
table or position embedding) + ``lm_head`` (Linear hidden → vocab) + ``value_head`` (Linear
hidden → 1), with the reference policies' contract (``autoshard.models``)
``forward(input_ids [B, S]) -> (logits [B, S, V], values [B, S])``, so the benchmarks'
``policy_loss`` applies as is. Weights are random: nothing is read from a hub. The zoo exists for
the cost model's accuracy campaign (predicted vs measured step time and peak memory on models the
project did not write); ``build_hf_policy("hf-qwen2:1.5b")`` builds one by spec.

Specs ``FAMILY:SIZE`` (``SPECS``; ``tiny`` of every family is for CPU tests; params are the
policy's, value head included, tied weights once; L layers, h hidden, a heads, kv KV heads,
f FFN width, V vocabulary):

==================  ==============================  ======  ===  ====  ===  ===  =====  ======  =====
spec                shapes of                       params   L    h     a   kv     f      V    tied
==================  ==============================  ======  ===  ====  ===  ===  =====  ======  =====
hf-llama:1b         TinyLlama-1.1B                  1.10B   22  2048   32    4   5632   32000   no
hf-llama:7b         Llama-2-7B                      6.74B   32  4096   32   32  11008   32000   no
hf-qwen2:0.5b       Qwen2-0.5B                      0.49B   24   896   14    2   4864  151936  yes
hf-qwen2:1.5b       Qwen2-1.5B                      1.54B   28  1536   12    2   8960  151936  yes
hf-gpt2:350m        gpt2-medium                     0.36B   24  1024   16   16   4096   50257  yes
hf-gpt2:774m        gpt2-large                      0.78B   36  1280   20   20   5120   50257  yes
hf-gpt2:1.5b        gpt2-xl                         1.56B   48  1600   25   25   6400   50257  yes
hf-gemma:2b         gemma-2b (head_dim 256)         2.51B   18  2048    8    1  16384  256000  yes
hf-phi:1.3b         phi-1_5                         1.42B   24  2048   32   32   8192   51200   no
hf-phi:2.7b         phi-2                           2.78B   32  2560   32   32  10240   51200   no
hf-mixtral:1.5b     Mixtral, 8 experts top-2        1.53B   16  1024   16    8   3584   32000   no
==================  ==============================  ======  ===  ====  ===  ===  =====  ======  =====

Every config: ``attn_implementation="sdpa"``, ``use_cache=False``, ``pad_token_id=None`` (the
training case is unpadded; an ``nn.Embedding(padding_idx=...)`` would zero a row's gradient and
make HF zero it at init), dropout 0 (the reference policies have none; GPT-2's default is 0.1).
Family specifics, all in HF's own modules except where the loop says otherwise:

* ``hf-llama``: RMSNorm, SwiGLU, GQA, RoPE; untied (TinyLlama, Llama-2).
* ``hf-qwen2``: Llama's layout plus q/k/v biases, RoPE theta 1e6, RMSNorm eps 1e-6; tied
  embeddings (0.5B and 1.5B tie; 7B would not). ``max_position_embeddings`` 32768 (shapes do not
  depend on it).
* ``hf-gpt2``: learned position embeddings (``wpe``, added in the loop as ``GPT2Model.forward``
  does), ``Conv1D`` projections (``addmm`` on a [in, out] weight), fused ``c_attn``, LayerNorm,
  GELU (tanh), tied. ``n_positions`` is 2048, not GPT-2's 1024, so the campaign's sequence
  length 2048 runs (+1M parameters at 350m).
* ``hf-gemma``: the embedding scaled by sqrt(hidden) (``GemmaTextScaledWordEmbedding``, whose
  ``embed_scale`` is a non-persistent buffer), RMSNorm computing ``x̂ (1 + w)``, GeGLU, MQA
  (one KV head), head_dim 256, tied.
* ``hf-phi``: one LayerNorm per block feeding attention and MLP in parallel
  (``x + attn(ln(x)) + mlp(ln(x))``), partial rotary (40% of phi-2's head_dim, 50% of
  phi-1.5's), GELU MLP, q/k/v/dense/fc biases, ``lm_head`` with a bias; untied.
* ``hf-mixtral``: Llama's attention with GQA; each block's ``mlp`` a ``MixtralSparseMoeBlock``
  (a router ``gate`` and 3-D expert weights ``experts.gate_up_proj`` [E, 2f, h] /
  ``experts.down_proj`` [E, h, f]), one ``moe`` layer per block for capture. HF's ``eager``
  experts loop over ``nonzero()`` experts, which neither export nor meta can run; the zoo picks
  HF's export-friendly implementations: ``grouped_mm`` (``torch._grouped_mm`` over
  expert-sorted tokens, what GPUs run: ``hf-mixtral:1.5b``) and ``batched_mm`` (a ``bmm``
  against each token's gathered expert weights: ``hf-mixtral:tiny``, since torch's meta kernel
  of ``_grouped_mm`` takes bf16 only and CPU tests capture and run fp32; ``batched_mm`` holds a
  [tokens·k, 2f, h] weight copy, fine at tiny sizes only). ``experts_implementation=`` overrides
  either. The router's load-balancing loss is not added (HF adds it only with
  ``output_router_logits``).

Initialisation (``init_rule``, by module type as HF's ``PreTrainedModel._init_weights`` and each
family's override): Linear, Embedding and ``Conv1D`` weights, Mixtral's expert tensors and router
N(0, initializer_range²) (0.02); GPT-2's ``c_proj`` (attention and MLP) N(0, (0.02/√(2L))²) as
HF's GPT-2 scheme; LayerNorm and RMSNorm weights 1, except Gemma's RMSNorm, 0 (HF's: the norm
multiplies by 1 + w); biases 0. Values come from ``autoshard.init``'s counter-based generator, so
a sharded build (autoshard's ``Initialize``, or FSDP2 shards initialised in place) equals the
single-device ``init_weights(seed)``. Tied families point ``lm_head.weight`` at the trunk's input
embedding (``tie_weights``, again after ``to_empty``, as the reference GPT does); capture then
lists it in ``lm_head``'s ``tied_params`` and the runtime keeps one tensor.

Buffers: the rotary tables (``inv_freq``, ``original_inv_freq``) and Gemma's ``embed_scale`` are
non-persistent buffers: no parameter, in no checkpoint, and garbage after ``to_empty``. A "meta"
model keeps them computed on the CPU (parameters on meta, buffers real: what accelerate's
``init_empty_weights`` does by default), which is where autoshard's sharded build copies buffers
from (``runtime/materialize.py``: a meta buffer nobody provides is refused); ``init_buffers``
recomputes them, in fp32 as HF makes them, after ``to_empty`` (``init_weights`` calls it).

Tensor parallelism (decision): the zoo campaign plans these models data-parallel only
(``mesh_pins`` → tp = 1: replicate, ZeRO-1/2/3, HSDP; the searched plan is restricted so and
forced variants with tp > 1 are skipped, ``baselines/plans.py``), so that its recorded cost-model
table measures one kind of plan. The runtime trains them under Megatron TP (+SP) like plain
PyTorch on gloo (``tests/test_hf_tensor_parallel.py``; ``autoshard/models/hf.py`` says what is
refused), and ``benchmarks/hf_train.py --tp 2`` ran a 1.1B Llama so on 2 GPUs. A family leaves
``mesh_pins`` when the zoo measures its TP plans.

[Note: capturing a Hugging Face trunk on meta]
What ``autoshard.passes.capture`` (and so ``autoshard.compile``) needed, measured with
transformers 5.17 and torch 2.13 on Llama, and the same for every family here:

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
   own modules in the trunk ``forward``'s order (``_trunk`` of each policy class: embedding,
   rotary table or position embedding, each decoder layer, final norm) with
   ``attention_mask=None``, i.e. the causal, unpadded training case. HF's SDPA integration then
   passes ``is_causal=True`` and no mask, in eager and in the export alike (flash on GPUs;
   capture prices it so). Every weight-holding module, and the attention and MLP code, is HF's;
   only the few-line loop of the trunk is ours, and a test holds it equal to the trunk's own
   ``forward`` per family. No cache is made (``use_cache=False`` in the config too: the issue
   tracker reports that ``DynamicCache`` fails export; not re-tested, since this forward never
   creates one); ``attn_implementation="sdpa"`` keeps the attention one op.
4. Layers and kinds come out of capture's heuristics without help (``model`` is a
   parameterless wrapper capture descends into): the embedding (``model.embed_tokens``; GPT-2's
   ``model.wte`` and ``model.wpe``), each block's norms, attention and MLP
   (``model.layers.i.*``; GPT-2's ``model.h.i.{ln_1, attn, ln_2, mlp}``; Mixtral's ``mlp`` is
   one ``moe`` layer: capture no longer takes the whole trunk for one ``moe`` layer because
   some descendant holds 3-D parameters, ``passes/_capture_layers.py``), the final norm,
   ``lm_head`` head, ``value_head``. Every op is priced: capture prices the ops inside the
   rotary table's ``no_grad`` region and HF's grouped expert matmuls.
5. Two things capture does differently here than for the reference models, both harmless:
   the rotary table is made inside ``model.rotary_emb`` (a submodule, not the root), so its
   saved cos/sin are charged to block 0's attention, whose ``class_id`` then differs from
   blocks 1..L-1 (the solver decides it apart); and the block list is not a child of the root,
   so the three-block export proxy (``passes/_capture_proxy.py``) does not apply and every
   block is exported (Llama-2-7B: 13 s on the 2-core CPU, ``llama:7b`` 2-5 s).
6. ``build_program`` exports a meta twin and points the graph's ``device=meta`` arguments at the
   rank's device (``passes/_graph_utils.retarget_device``). HF's rotary ``forward`` runs under
   ``@torch.no_grad()``, which export keeps as a ``wrap_with_set_grad_enabled`` subgraph;
   ``retarget_device`` walks into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch



from autoshard.models.hf import (  # noqa: F401 - the policies live in the package; re-exported here
    HFGPT2Policy, HFGemmaPolicy, HFLlamaPolicy, HFMixtralPolicy, HFPhiPolicy, HFPolicy, HFQwen2Policy, RotaryPolicy,
    _transformers, actor_critic,
)


# --------------------------------------------------------------------------- families and sizes


@dataclass(frozen=True)
class Family:
    """One ``hf-*`` family: its config class, policy class, shared config fields and sizes.

    config_class: the ``transformers`` config class name; policy: the ``HFPolicy`` subclass;
    common: config fields of every size (before the zoo-wide ones); sizes: size → config fields;
    shapes_of: size → the Hugging Face model whose shapes it has (documentation, the table).
    """

    name: str
    config_class: str
    policy: type[HFPolicy]
    common: Mapping[str, Any]
    sizes: Mapping[str, Mapping[str, Any]]
    shapes_of: Mapping[str, str] = field(default_factory=dict)


def _llama_like(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, max_pos: int,
                **extra: Any) -> dict[str, Any]:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=max_pos, **extra)


def _gpt2(hidden: int, layers: int, heads: int, vocab: int = 50257, positions: int = 2048) -> dict[str, Any]:
    return dict(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=positions)


_NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("hf-llama", "LlamaConfig", HFLlamaPolicy,
           dict(rms_norm_eps=1e-5, tie_word_embeddings=False),
           {"tiny": _llama_like(64, 2, 4, 2, 128, 256, 128),
            "1b": _llama_like(2048, 22, 32, 4, 5632, 32000, 2048),
            "7b": _llama_like(4096, 32, 32, 32, 11008, 32000, 4096)},
           {"1b": "TinyLlama-1.1B", "7b": "Llama-2-7B"}),
    Family("hf-qwen2", "Qwen2Config", HFQwen2Policy,
           dict(rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
           {"tiny": _llama_like(64, 2, 4, 2, 128, 256, 128),
            "0.5b": _llama_like(896, 24, 14, 2, 4864, 151936, 32768),
            "1.5b": _llama_like(1536, 28, 12, 2, 8960, 151936, 32768)},
           {"0.5b": "Qwen2-0.5B", "1.5b": "Qwen2-1.5B"}),
    Family("hf-gpt2", "GPT2Config", HFGPT2Policy,
           dict(layer_norm_epsilon=1e-5, tie_word_embeddings=True, activation_function="gelu_new", **_NO_DROPOUT_GPT2),
           {"tiny": _gpt2(64, 2, 4, vocab=256, positions=128),
            "350m": _gpt2(1024, 24, 16), "774m": _gpt2(1280, 36, 20), "1.5b": _gpt2(1600, 48, 25)},
           {"350m": "gpt2-medium", "774m": "gpt2-large", "1.5b": "gpt2-xl"}),
    Family("hf-gemma", "GemmaConfig", HFGemmaPolicy,
           dict(rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh"),
           {"tiny": _llama_like(64, 2, 4, 1, 256, 256, 128, head_dim=32),
            "2b": _llama_like(2048, 18, 8, 1, 16384, 256000, 8192, head_dim=256)},
           {"2b": "gemma-2b"}),
    Family("hf-phi", "PhiConfig", HFPhiPolicy,
           dict(layer_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="gelu_new", resid_pdrop=0.0,
                embd_pdrop=0.0, attention_dropout=0.0),
           {"tiny": _llama_like(64, 2, 4, 4, 256, 256, 128, partial_rotary_factor=0.5),
            "1.3b": _llama_like(2048, 24, 32, 32, 8192, 51200, 2048, partial_rotary_factor=0.5),
            "2.7b": _llama_like(2560, 32, 32, 32, 10240, 51200, 2048, partial_rotary_factor=0.4)},
           {"1.3b": "phi-1_5", "2.7b": "phi-2"}),
    Family("hf-mixtral", "MixtralConfig", HFMixtralPolicy,
           dict(rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=2, router_jitter_noise=0.0),
           {"tiny": _llama_like(64, 2, 4, 2, 128, 256, 128, num_local_experts=4, experts_implementation="batched_mm"),
            "1.5b": _llama_like(1024, 16, 16, 8, 3584, 32000, 4096, num_local_experts=8,
                                experts_implementation="grouped_mm")},
           {"1.5b": "Mixtral (8 experts, top-2), scaled down"}),
)}
SPECS = tuple(f"{family.name}:{size}" for family in FAMILIES.values() for size in family.sizes)
# Zoo-wide config fields (module docstring); a size's fields and the caller's overrides win.
_ZOO_FIELDS = dict(attn_implementation="sdpa", use_cache=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def split_spec(spec: str) -> tuple[Family, str]:
    """``"hf-qwen2:1.5b"`` → (its ``Family``, ``"1.5b"``); unknown families and sizes are refused."""
    name, _, size = spec.partition(":")
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"{spec!r}: not an hf-* spec; allowed families {sorted(FAMILIES)} (FAMILY:SIZE)")
    if size not in family.sizes:
        raise ValueError(f"{spec!r}: unknown {name} size {size!r}; allowed {sorted(family.sizes)}")
    return family, size


def hf_config(spec: str, **overrides: Any):
    """The ``transformers`` config of ``spec`` (module docstring); ``overrides`` win."""
    family, size = split_spec(spec)
    fields = {**_ZOO_FIELDS, **family.common, **family.sizes[size], **overrides}
    return getattr(_transformers(), family.config_class)(**fields)


def is_hf_spec(spec: str) -> bool:
    """Whether ``spec`` names a family of this zoo (``hf-llama:SIZE``, ``hf-qwen2:SIZE``, ...)."""
    return spec.split(":", 1)[0] in FAMILIES


def mesh_pins(spec: str) -> dict[str, int]:
    """Mesh degrees the benchmark's search must keep for ``spec``: tp = 1 for the zoo (module docstring)."""
    return {"tp": 1} if is_hf_spec(spec) else {}


def build_hf_policy(spec: str, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                    seed: int = 0, **overrides: Any) -> HFPolicy:
    """The policy of ``spec`` (``"hf-llama:7b"``) on ``device``, initialised with ``seed`` unless meta.

    Constructed on meta (no memory, no init), parameters cast to ``dtype``. On ``"meta"`` the
    buffers (rotary tables, Gemma's embedding scale; fp32 as HF keeps them) are computed on the
    CPU, as accelerate's ``init_empty_weights(include_buffers=False)`` leaves them: a sharded
    build copies buffers from the model and no checkpoint holds them. On a real device the model
    is materialised with ``to_empty``, re-tied and ``init_weights(seed)``. ``overrides`` go to the
    config.
    """
    split_spec(spec)  # refuses a spec outside the zoo
    return actor_critic(hf_config(spec, **overrides), device=device, dtype=dtype, seed=seed)


# --------------------------------------------------------------------------- Llama helpers kept from hf_policy

FAMILY = "hf-llama"
SIZES = FAMILIES[FAMILY].sizes


def hf_llama_config(size: str, **overrides: Any):
    """``transformers.LlamaConfig`` of ``hf-llama:SIZE``."""
    return hf_config(f"{FAMILY}:{size}", **overrides)


def hf_llama_7b(**overrides: Any):
    """Llama-2-7B's ``LlamaConfig`` (module docstring)."""
    return hf_llama_config("7b", **overrides)


def hf_llama_tiny(**overrides: Any):
    """A 2-layer, hidden-64 ``LlamaConfig`` of the same family, for CPU tests."""
    return hf_llama_config("tiny", **overrides)


__all__ = ["FAMILIES", "FAMILY", "SIZES", "SPECS", "Family", "HFGPT2Policy", "HFGemmaPolicy", "HFLlamaPolicy",
           "HFMixtralPolicy", "HFPhiPolicy", "HFPolicy", "HFQwen2Policy", "RotaryPolicy", "build_hf_policy",
           "hf_config", "hf_llama_7b", "hf_llama_config", "hf_llama_tiny", "is_hf_spec", "mesh_pins", "split_spec"]
