"""Sharded materialization: programs built from the meta device, a DCP checkpoint or safetensors files.

Every rank returns, per parameter it holds, its region of the global tensor and the values of its fp32
master and compute shard; the parent places the regions into full tensors and compares them with the
single-device build (``build(spec)`` = ``init_weights(seed)``) or the file, exactly. One spawned gloo job
per world size runs every case.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

from _harness import run_gloo_cases
from _runtime_cases import BATCH, SEQ, batches, loss_fn
from autoshard.init import WORKSPACE_BYTES, Normal, full_region, init_region
from autoshard.models import build
from autoshard.passes import capture
from autoshard.passes._graph_utils import retarget_device
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import BuildOptions, build_program
from autoshard.runtime._checkpoint_files import CheckpointError
from autoshard.runtime.checkpoint import program_state, save
from autoshard.runtime.materialize import (Checkpoint, Initialize, Safetensors, WeightsError, meta_twin)
from autoshard.runtime.optimizer import OptimizerConfig
from autoshard.train import TrainSpec

OPT = OptimizerConfig(name="adamw", lr=1e-3)
TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32")
BIG = dict(hidden=256, num_layers=8, num_heads=4, num_kv_heads=2, ffn_hidden=768, vocab_size=512)


@functools.lru_cache(maxsize=None)
def _graph(spec: str, big: bool = False):
    return capture(build(spec, device="meta", **(BIG if big else {})), seq_lens=(8, 16))


def _stage(layer: str, stages: int, num_layers: int) -> int:
    if layer.startswith("blocks."):
        return int(layer.split(".")[1]) * stages // num_layers
    return 0 if layer in ("embed", "pos_embed") else stages - 1


def _plan(spec: str, mesh: Mesh, choose, big: bool = False) -> Plan:
    graph = _graph(spec, big)
    layers = []
    for layer in graph.layers:
        fields = dict(choose(layer.name))
        if mesh.pp > 1:
            fields["stage"] = _stage(layer.name, mesh.pp, len({l.block for l in graph.layers if l.block is not None}))
        layers.append(LayerStrategy(layer=layer.name, **fields))
    micro = max(1, 4 // mesh.dp)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=tuple(layers), schedule=Schedule(num_micro_batches=micro))


def _regions(program) -> dict[str, tuple]:
    """fqn → (region, fp32 master at the local shape, compute parameter) of this rank."""
    masters = program.local_state_dict()
    params = program.gm.local_parameters() if program.pipeline is not None else dict(program.gm.named_parameters())
    return {fqn: (placement.region(program.ctx), masters[fqn], params[fqn].detach().clone())
            for fqn, placement in program.param_placements.items() if fqn in masters}


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's regions; every element must be covered, and copies must agree."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for fqn, (region, master, param) in result["regions"].items():
            torch.testing.assert_close(param.float(), master, rtol=0, atol=0)  # compute copy = master (fp32 run)
            shape = result["shapes"][fqn]
            out = full.setdefault(fqn, torch.full(shape, float("nan")))
            mask = seen.setdefault(fqn, torch.zeros(shape, dtype=torch.bool))
            done = out[region][mask[region]]
            assert torch.equal(done, master[mask[region]]), f"{fqn}: ranks disagree on a replicated region"
            out[region] = master
            mask[region] = True
    for fqn, mask in seen.items():
        assert bool(mask.all()), f"{fqn}: no rank holds some elements"
    return full


def build_case(rank, world_size, spec, plan, weights=None, big=False, steps=0, track=False, save_to=None):
    """Build ``plan`` from ``build(spec, device='meta')`` (or ``weights``); regions, losses, memory report."""
    model = build(spec, device="meta", **(BIG if big else {}))
    program = build_program(model, _graph(spec, big), plan, TRAIN, optimizer=OPT, weights=weights,
                            options=BuildOptions(track_memory=track))
    out = {"memory": program.memory_report(),
           "shapes": {f: p.global_shape for f, p in program.param_placements.items()},
           "local_bytes": {f: 4 * torch.Size(p.local_shape).numel() for f, p in program.param_placements.items()}}
    out["losses"] = [program.step(program.local_batch(t), loss_fn).loss for t in batches()[:steps]]
    out["regions"] = _regions(program)  # after the steps
    if save_to is not None:
        save(save_to, program_state(program))
    return out


def compile_case(rank, world_size, on_meta):
    """``autoshard.compile`` under the process group: a meta model is initialised on shards; a CPU model is
    read, then released to the meta device."""
    import autoshard

    model = build(LLAMA, device="meta" if on_meta else "cpu")
    compiled = autoshard.compile(model, "cpu:1x2", train=TRAIN, name=LLAMA, time_limit_s=20)
    program = compiled.program
    return {"regions": _regions(program), "shapes": {f: p.global_shape for f, p in program.param_placements.items()},
            "released": all(p.is_meta for p in model.parameters())}


def refused_case(rank, world_size, spec, plan, weights):
    """The error text of building from ``weights`` (every rank must refuse before reading a tensor)."""
    try:
        build_program(build(spec, device="meta"), _graph(spec), plan, TRAIN, optimizer=OPT, weights=weights)
    except (CheckpointError, WeightsError) as err:
        return str(err)
    return None


def _single(spec: str, big: bool = False) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build(spec, **(BIG if big else {})).named_parameters()}


def _hf_key(fqn: str) -> str:
    return f"model.{fqn}"


def _replicate(_):
    return {"state": "replicate"}


def _state(state):
    return lambda _layer: {"state": state}


def _tp_sp(layer):
    return {"tp": "megatron", "sp": layer.endswith("norm") or layer.endswith("attn") or layer.endswith("mlp")}


def _mixed(layer):
    if layer.endswith("attn"):
        return {"state": "zero3"}
    if layer.endswith("mlp"):
        return {"state": "zero2", "tp": "megatron"}
    return {"state": "offload" if layer == "head" else "zero1"}


def _ep(layer):
    return {"ep": True} if layer.endswith("moe") else {"state": "zero3"}


LLAMA, GPT, MOE = "llama:tiny", "gpt:tiny", "moe:tiny"
CASES_2 = {
    "ddp": (LLAMA, Mesh(dp_shard=2), _replicate),
    "zero1": (LLAMA, Mesh(dp_shard=2), _state("zero1")),
    "zero2": (LLAMA, Mesh(dp_shard=2), _state("zero2")),
    "zero3": (LLAMA, Mesh(dp_shard=2), _state("zero3")),
    "offload": (LLAMA, Mesh(dp_shard=2), _state("offload")),
    "tp_sp": (LLAMA, Mesh(tp=2), _tp_sp),
    "tp_gpt_tied": (GPT, Mesh(tp=2), lambda _l: {"tp": "megatron"}),
    "zero3_gpt_tied": (GPT, Mesh(dp_shard=2), _state("zero3")),
    "ep": (MOE, Mesh(dp_shard=2, ep=2), _ep),
    "pp": (LLAMA, Mesh(pp=2), _replicate),
}
CASES_4 = {
    "hsdp": (LLAMA, Mesh(dp_replicate=2, dp_shard=2), _state("zero3")),
    "tp2_dp2_mixed": (LLAMA, Mesh(dp_shard=2, tp=2), _mixed),
    "pp2_dp2_zero3": (GPT, Mesh(pp=2, dp_shard=2), _state("zero3")),
    "ep2_dp4": (MOE, Mesh(dp_shard=4, ep=2), _ep),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The single-device llama:tiny as a safetensors file (bf16) and as an HF sharded dir with 'model.' keys."""
    from autoshard.runtime._safetensors_source import write_sharded
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("weights")
    ref = _single(LLAMA)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in ref.items()}, str(root / "model.safetensors"))
    write_sharded({f"model.{k}": v for k, v in ref.items()}, root / "hf", max_shard_bytes=40_000)
    assert len(list((root / "hf").glob("model-*-of-*.safetensors"))) > 1
    wrong = dict(ref)
    wrong["norm.weight"] = torch.ones(7)
    save_file(wrong, str(root / "wrong_shape.safetensors"))
    return root


@pytest.fixture(scope="module")
def results2(files):
    jobs = {name: functools.partial(build_case, spec=spec, plan=_plan(spec, mesh, choose))
            for name, (spec, mesh, choose) in CASES_2.items()}
    zero3, zero1 = _plan(LLAMA, Mesh(dp_shard=2), _state("zero3")), _plan(LLAMA, Mesh(dp_shard=2), _mixed)
    jobs["train_zero3"] = functools.partial(build_case, spec=LLAMA, plan=zero3, steps=2, save_to=str(files / "ckpt"))
    jobs["from_checkpoint"] = functools.partial(build_case, spec=LLAMA, plan=zero1, weights=Checkpoint(files / "ckpt"))
    jobs["from_file"] = functools.partial(build_case, spec=LLAMA, plan=zero3, weights=str(files / "model.safetensors"))
    jobs["from_hf_dir"] = functools.partial(build_case, spec=LLAMA, plan=_plan(LLAMA, Mesh(tp=2), _tp_sp),
                                            weights=Safetensors(files / "hf", name_map=_hf_key))
    jobs["compile_meta"] = functools.partial(compile_case, on_meta=True)
    jobs["compile_cpu"] = functools.partial(compile_case, on_meta=False)
    jobs["refuse_other_model"] = functools.partial(refused_case, spec=GPT, plan=_plan(GPT, Mesh(dp_shard=2), _replicate),
                                                   weights=Checkpoint(files / "ckpt"))
    jobs["refuse_shape"] = functools.partial(refused_case, spec=LLAMA, plan=zero3,
                                             weights=str(files / "wrong_shape.safetensors"))
    jobs["refuse_missing_prefix"] = functools.partial(refused_case, spec=LLAMA, plan=zero3, weights=str(files / "hf"))
    return run_gloo_cases(jobs, 2, timeout_s=600)


@pytest.fixture(scope="module")
def results4():
    jobs = {name: functools.partial(build_case, spec=spec, plan=_plan(spec, mesh, choose))
            for name, (spec, mesh, choose) in CASES_4.items()}
    jobs["memory_zero3"] = functools.partial(build_case, spec=LLAMA, plan=_plan(LLAMA, Mesh(dp_shard=4), _state("zero3"),
                                                                                big=True), big=True, track=True)
    return run_gloo_cases(jobs, 4, timeout_s=600)


def _check_single_device(per_rank: list[dict], spec: str) -> None:
    full, ref = _assemble(per_rank), _single(spec)
    assert set(full) == set(ref)
    for fqn, value in full.items():
        assert torch.equal(value, ref[fqn]), fqn


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_2))
def test_meta_init_equals_single_device_world2(results2, name):
    _check_single_device(results2[name], CASES_2[name][0])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_4))
def test_meta_init_equals_single_device_world4(results4, name):
    _check_single_device(results4[name], CASES_4[name][0])


@pytest.mark.slow
def test_compile_builds_from_meta_and_releases_a_materialised_model(results2):
    ref = _single(LLAMA)
    for name in ("compile_meta", "compile_cpu"):
        for fqn, value in _assemble(results2[name]).items():
            assert torch.equal(value, ref[fqn]), (name, fqn)
    assert all(r["released"] for r in results2["compile_cpu"])  # the user's module now holds no data


@pytest.mark.slow
def test_meta_build_trains_like_single_device(results2):
    """Two AdamW steps of the meta-built ZeRO-3 program: the loss of a single-device AdamW run."""
    model = build(LLAMA)
    opt = torch.optim.AdamW(model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=0.0)
    losses = []
    for toks in batches()[:2]:
        total = 0.0
        for chunk in toks.chunk(4, 0):
            loss = loss_fn(model(chunk), chunk) / 4
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    for rank in results2["train_zero3"]:
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_checkpoint_of_one_plan_loads_into_another(results2):
    """Saved after two steps under ZeRO-3, loaded into a mixed ZeRO-1/2/3/offload + TP plan: the saved values."""
    saved = _assemble(results2["train_zero3"])
    loaded = _assemble(results2["from_checkpoint"])
    assert not torch.equal(saved["embed.weight"], _single(LLAMA)["embed.weight"])  # it trained
    for fqn, value in loaded.items():
        assert torch.equal(value, saved[fqn]), fqn


@pytest.mark.slow
def test_safetensors_file_and_hf_directory_load_into_shards(results2):
    ref = _single(LLAMA)
    for fqn, value in _assemble(results2["from_file"]).items():
        assert torch.equal(value, ref[fqn].to(torch.bfloat16).float()), fqn  # the file holds bf16
    for fqn, value in _assemble(results2["from_hf_dir"]).items():
        assert torch.equal(value, ref[fqn]), fqn


@pytest.mark.slow
def test_bad_weights_are_one_line_errors_on_every_rank(results2):
    for name, needle in (("refuse_other_model", "another model"), ("refuse_shape", "norm.weight"),
                         ("refuse_missing_prefix", "model.")):
        messages = results2[name]
        assert all(m is not None and needle in m and "\n" not in m for m in messages), (name, messages)


@pytest.mark.slow
def test_build_memory_is_the_rank_share_plus_one_parameter(results4):
    """ZeRO-3 over 4 ranks from meta: live bytes during the build stay within this rank's resident state
    (measured after the build) plus two fp32 regions of its largest parameter and the initialiser's fixed
    workspace, far below one model copy."""
    full_fp32 = sum(4 * torch.Size(s).numel() for s in results4["memory_zero3"][0]["shapes"].values())
    for rank in results4["memory_zero3"]:
        report = rank["memory"]
        largest_region = max(rank["local_bytes"].values())
        assert report.build_peak_bytes <= report.resident_bytes + 2 * largest_region + WORKSPACE_BYTES, report
        # the build's extra bytes are a small fraction of one fp32 copy of the model (the old build held ~2)
        assert report.build_peak_bytes - report.resident_bytes < full_fp32 / 8, (report, full_fp32)
    # resident = fp32 compute shard + master + two AdamW moments of a quarter: the four ranks' sum is the whole state
    total = sum(rank["memory"].resident_bytes for rank in results4["memory_zero3"])
    assert total <= 4.2 * full_fp32
    assert all(rank["memory"].build_peak_bytes < 0.3 * total for rank in results4["memory_zero3"])


# --------------------------------------------------------------------------- one process


def test_counter_init_is_the_same_for_any_region():
    rule = Normal(0.0, 0.02)
    whole = init_region(rule, 3, "w", (37, 11), full_region((37, 11)))
    assert torch.equal(init_region(rule, 3, "w", (37, 11), (slice(5, 30), slice(2, 9))), whole[5:30, 2:9])
    assert not torch.equal(init_region(rule, 4, "w", (37, 11), full_region((37, 11))), whole)  # the seed matters
    assert not torch.equal(init_region(rule, 3, "v", (37, 11), full_region((37, 11))), whole)  # the name matters
    big = init_region(rule, 0, "x", (512, 512), full_region((512, 512)))
    assert abs(float(big.mean())) < 1e-3 and abs(float(big.std()) - 0.02) < 5e-4


def test_counter_init_workspace_is_bounded_when_one_row_is_larger_than_a_chunk():
    """An expert weight's ZeRO-3 chunk ``[1, f, h]`` is one dim-0 row of f·h elements: init cuts it along f, so
    its temporaries stay one chunk's workspace (a Mixtral expert slab: 0.44 GiB of int64 index, five such
    temporaries live at once before), and its values are those of any other cut."""
    from autoshard.live_bytes import LiveBytes

    rule, shape = Normal(0.0, 0.02), (4, 512, 256)  # one row: 131,072 elements, twice the CPU's chunk of 65,536
    region = (slice(1, 2), slice(0, 512), slice(0, 256))
    with LiveBytes() as live:
        slab = init_region(rule, 5, "experts.w1", shape, region)
    out_bytes = slab.numel() * 4
    assert live.peak <= out_bytes + WORKSPACE_BYTES, (live.peak, out_bytes, WORKSPACE_BYTES)
    whole = init_region(rule, 5, "experts.w1", shape, full_region(shape))
    assert torch.equal(slab, whole[1:2])
    assert torch.equal(init_region(rule, 5, "experts.w1", shape, (slice(0, 4), slice(7, 300), slice(3, 250))),
                       whole[:, 7:300, 3:250])


def test_meta_twin_copies_no_data_and_keeps_ties():
    model = build(GPT)
    twin = meta_twin(model)
    assert all(p.is_meta for p in twin.parameters())
    assert twin.head.weight is twin.embed.weight
    assert not model.embed.weight.is_meta


def test_retarget_device_moves_baked_devices():
    twin = meta_twin(build(LLAMA))
    gm = torch.export.export(twin, (torch.zeros(2, 8, dtype=torch.long, device="meta"),), strict=False).module()
    assert retarget_device(gm, torch.device("meta"), torch.device("cpu")) > 0
    assert "type='meta'" not in gm.code and "type='cpu'" in gm.code


class _Net(nn.Module):
    """A model the project did not write: torch layers with their own reset_parameters, a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 16))
        self.register_buffer("scale", torch.full((16,), 0.5))


def _module_init_regions(model: nn.Module, weights) -> dict[str, torch.Tensor]:
    reader = weights.bind(model)
    wanted = [_Wanted(f, tuple(p.shape), full_region(tuple(p.shape))) for f, p in model.named_parameters()]
    reader.check({w.fqn: w.global_shape for w in wanted})
    return dict(reader.regions(wanted, torch.device("cpu")))


def _Wanted(fqn, shape, region):
    from autoshard.runtime.materialize import Wanted

    return Wanted(fqn, shape, region)


def test_module_init_fallback_equals_single_device_reset_parameters():
    with torch.device("meta"):
        model = _Net()
    got = _module_init_regions(model, Initialize(seed=7))
    torch.manual_seed(7)
    ref = _Net()  # constructors call reset_parameters module by module, children first
    ref_by_apply = {}
    torch.manual_seed(7)
    materialised = meta_twin(ref).to_empty(device="cpu")
    materialised.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    ref_by_apply = dict(materialised.named_parameters())
    for fqn, value in got.items():
        assert torch.equal(value, ref_by_apply[fqn].detach()), fqn


def test_init_function_touching_another_module_is_refused():
    with torch.device("meta"):
        model = _Net()

    def bad(module):
        if isinstance(module, nn.Sequential):
            module[0].weight.normal_()  # a child's parameter, not the module's own

    with pytest.raises(WeightsError, match="'body'.*not its own"):
        _module_init_regions(model, Initialize(module_init=bad))


def test_module_without_initialiser_is_named():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(WeightsError, match="'w'.*no initialiser"):
        _module_init_regions(Bare(), Initialize())


def test_unknown_weights_argument_is_refused():
    from autoshard.runtime.materialize import bind_source

    with pytest.raises(WeightsError, match="weights=42"):
        bind_source(42, build(LLAMA))


def test_plan_reads_hf_index_json_written_by_write_sharded(tmp_path):
    from autoshard.runtime._safetensors_source import write_sharded

    write_sharded({"a": torch.zeros(10), "b": torch.ones(10)}, tmp_path, max_shard_bytes=40)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"a", "b"}
