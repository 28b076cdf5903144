"""Cases of the Hugging Face tensor-parallel tests: tiny ``transformers`` trunks as ``autoshard.models.hf``
builds them, trained as ``_runtime_cases`` trains the reference models (3 SGD steps, fp32, 2 micro-batches,
clipping on), on gloo ranks and in one plain PyTorch process.

A model is named by a key of ``CONFIGS``; ``"+repeat_kv"`` appended runs HF's ``repeat_kv`` attention path
(``use_gqa_in_sdpa`` off: expand + reshape with the global head counts as literals) instead of SDPA's
``enable_gqa``, which transformers picks on this machine.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from _runtime_cases import MICRO, OPT, SEQ, BATCH, batches, loss_fn
from autoshard.models.hf import actor_critic
from autoshard.passes import capture
from autoshard.passes.context import RankContext
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import BuildOptions, build_program
from autoshard.runtime import export_cache
from autoshard.runtime.rollout_engine import unshard
from autoshard.search.space import is_tp_able
from autoshard.train import TrainSpec

_ROTARY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
CONFIGS = {
    "llama": ("LlamaConfig", _ROTARY),
    "llama_mqa": ("LlamaConfig", {**_ROTARY, "num_key_value_heads": 1}),
    "qwen2": ("Qwen2Config", _ROTARY),  # q/k/v carry biases
    "qwen3": ("Qwen3Config", {**_ROTARY, "head_dim": 16}),  # per-head RMSNorms on q and k
    "mixtral": ("MixtralConfig", {**_ROTARY, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "experts_implementation": "batched_mm"}),  # grouped_mm: bf16 only on meta
    "gemma": ("GemmaConfig", {**_ROTARY, "head_dim": 16}),
    "phi": ("PhiConfig", {**_ROTARY, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)),
}


@contextlib.contextmanager
def attention_path(name: str):
    """HF's ``repeat_kv`` path for ``"<model>+repeat_kv"`` (module docstring); nothing otherwise.

    The switch is process-global state the export cache cannot see (``runtime/export_cache.py`` note "the
    key"): the same twin would find the SDPA path's graph cached, or leave its own for a plain build. So
    the cache is off inside."""
    if not name.endswith("+repeat_kv"):
        yield
        return
    from transformers.integrations import sdpa_attention

    saved, cache = sdpa_attention.use_gqa_in_sdpa, os.environ.get(export_cache.ENV)
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False
    os.environ[export_cache.ENV] = "0"
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = saved
        if cache is None:
            del os.environ[export_cache.ENV]
        else:
            os.environ[export_cache.ENV] = cache


def config_of(name: str):
    import transformers

    cls, fields = CONFIGS[name.split("+")[0]]
    return getattr(transformers, cls)(**fields)


def build_hf(name: str) -> torch.nn.Module:
    """The fp32 policy, materialised on the CPU with HF's init rules (seed 0): the same in every process."""
    return actor_critic(config_of(name), device="cpu", dtype=torch.float32, seed=0)


@functools.lru_cache(maxsize=None)
def graph_of(name: str):
    with attention_path(name):
        return capture(actor_critic(config_of(name), dtype=torch.float32), seq_lens=(8, 16))


def tp_plan(name: str, mesh: Mesh, state: str = "replicate", sp: bool = False) -> Plan:
    """Megatron tp on every tp-able layer (the search's rule), ``state`` on every layer."""
    graph = graph_of(name)
    layers = tuple(LayerStrategy(layer=layer.name, state=state if layer.params else "replicate",
                                 tp="megatron" if is_tp_able(layer) else "none", sp=sp) for layer in graph.layers)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=Schedule(num_micro_batches=MICRO))


def single_device(name: str):
    """Losses and final parameters of plain single-process training (``_runtime_cases.single_device``)."""
    from _runtime_cases import single_device as reference

    with attention_path(name):
        return reference(name, builder=build_hf)


def train_case(rank, world_size, name: str, plan: Plan):
    """Build ``plan`` for ``name`` on this rank, train; losses, local shards, placements, coordinates."""
    del rank, world_size
    with attention_path(name):
        program = build_program(build_hf(name), graph_of(name), plan,
                                TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"), optimizer=OPT,
                                options=BuildOptions(compile=False))
        losses = [program.step(program.local_batch(tokens), loss_fn).loss for tokens in batches()]
        unsharded = {fqn: unshard(slot.param, program.param_placements[fqn], program.ctx).clone()
                     for fqn, slot in program.optimizer.slots.items()}  # what the rollout replica is synced from
    return {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
            "coords": program.ctx.coords, "unsharded": unsharded, "checkpoint": _checkpoint_error(program)}


def _checkpoint_error(program) -> str:
    """The ``CheckpointError`` a checkpoint of ``program`` raises, or "" (no file is written either way); every
    plan here, fused projections split over tp included, is checkpointable (``tests/test_checkpoint_fused_tp.py``)."""
    from autoshard.runtime.checkpoint import CheckpointError, program_state

    try:
        program_state(program)
    except CheckpointError as err:
        return str(err)
    return ""


def reassemble(results: list[dict], mesh: Mesh) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's shards, each block put where its ``ParamPlacement.regions`` says."""
    full: dict[str, torch.Tensor] = {}
    for r in results:
        ctx = RankContext(rank=0, world_size=mesh.world_size, mesh=mesh, coords=r["coords"])
        for fqn, placement in r["placements"].items():
            target = full.setdefault(fqn, torch.full(placement.global_shape, float("nan")))
            regions = placement.regions(ctx)
            pieces = r["shards"][fqn].split([s[placement.tp_dim].stop - s[placement.tp_dim].start for s in regions],
                                            placement.tp_dim) if len(regions) > 1 else [r["shards"][fqn]]
            for region, piece in zip(regions, pieces):
                target[region] = piece
    return full


def check_against_reference(results: list[dict], reference, mesh: Mesh, rtol=1e-5, atol=1e-6) -> None:
    ref_losses, ref_params = reference
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    full = reassemble(results, mesh)
    assert set(full) == set(ref_params)
    for r in results:  # the rollout replica's weights: every rank's all-gathers, fused parts in order
        assert all(torch.equal(r["unsharded"][fqn], full[fqn]) for fqn in full)
        assert r["checkpoint"] == "", r["checkpoint"]
    for fqn, value in full.items():
        torch.testing.assert_close(value, ref_params[fqn], rtol=rtol, atol=atol, msg=lambda m: f"{fqn}: {m}")
