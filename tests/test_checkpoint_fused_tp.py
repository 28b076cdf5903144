"""Checkpoints of a fused projection split over tp: GPT-2's ``c_attn`` ([q | k | v]) under tp 2, where each
rank holds its chunk of every part (``passes/context.py``) and ``runtime/checkpoint.py`` writes one DCP chunk
per block, so the files are those of any other plan.

One spawned 2-rank gloo job (module fixture ``job``), tiny random GPT-2 (``tests/_hf_tp_cases.py``), AdamW,
fp32: a tp 2 run and a ZeRO-3 dp 2 run each take one step, save, and take two more (the uninterrupted
record); fresh programs then resume each checkpoint under the same plan (next losses bit-identical) and
under the other (rtol 1e-5), and a tp 2 program is built from the tp checkpoint (``materialize``). The
parent reads the checkpoints whole, without a process group, and holds them to the runs' own shards put
together by ``ParamPlacement.regions`` (masters and both moments, bit for bit), and exports the tp one
to a Hugging Face directory that ``GPT2LMHeadModel.from_pretrained`` loads with the same values.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _harness import run_gloo_cases  # noqa: E402
from _hf_tp_cases import build_hf, config_of, graph_of, reassemble, tp_plan  # noqa: E402
from _runtime_cases import BATCH, MICRO, SEQ, batches, loss_fn  # noqa: E402
from autoshard.passes.context import RankContext, TpLayout, coords_of, placement_for  # noqa: E402
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule  # noqa: E402
from autoshard.runtime import checkpoint as ckpt  # noqa: E402
from autoshard.runtime._checkpoint_files import held_indices  # noqa: E402
from autoshard.runtime.optimizer import OptimizerConfig  # noqa: E402

MODEL = "gpt2"
TP2, DP2 = Mesh(tp=2), Mesh(dp_shard=2)
ADAMW = OptimizerConfig(name="adamw", lr=1e-2, max_grad_norm=1.0)
MOMENTS = ("exp_avg", "exp_avg_sq")
FUSED = "model.h.0.attn.c_attn.weight"  # policy names: the trunk under "model." (autoshard/models/hf.py)


# --------------------------------------------------------------------------- rank side


def _plan(mesh: Mesh) -> Plan:
    """Megatron tp on every tp-able layer under ``TP2``; ZeRO-3 on every layer under ``DP2``."""
    if mesh.tp > 1:
        return tp_plan(MODEL, mesh)
    graph = graph_of(MODEL)
    layers = tuple(LayerStrategy(layer=layer.name, state="zero3" if layer.params else "replicate")
                   for layer in graph.layers)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=Schedule(num_micro_batches=MICRO))


def _program(mesh: Mesh, weights=None):
    from autoshard.runtime import BuildOptions, build_program
    from autoshard.train import TrainSpec

    return build_program(build_hf(MODEL), graph_of(MODEL), _plan(mesh),
                         TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"), optimizer=ADAMW, weights=weights,
                         options=BuildOptions(compile=False))


def _snapshot(program) -> dict:
    """This rank's fp32 masters and AdamW moments, with what ``reassemble`` needs to put them together."""
    moments = program.optimizer.local_moments()
    return {"model": program.local_state_dict(),
            **{name: {fqn: states[name] for fqn, states in moments.items()} for name in MOMENTS},
            "placements": program.param_placements, "coords": program.ctx.coords}


def _steps(program, tokens) -> list[float]:
    return [program.step(program.local_batch(t), loss_fn).loss for t in tokens]


def _case_save(root: str, mesh: Mesh, rank: int, world_size: int) -> dict:
    """One step, a checkpoint of the program, two more steps (the uninterrupted run)."""
    program = _program(mesh)
    first = _steps(program, batches()[:1])
    saved = _snapshot(program)
    ckpt.save(Path(root), ckpt.program_state(program, step=1, model_fingerprint=graph_of(MODEL).fingerprint()))
    return {"first": first, "saved": saved, "after": _steps(program, batches()[1:])}


def _case_resume(root: str, mesh: Mesh, rank: int, world_size: int) -> dict:
    """A fresh program under ``mesh`` loads the checkpoint and takes the two steps after it."""
    program = _program(mesh)
    loaded = ckpt.load_program(Path(root), program, model_fingerprint=graph_of(MODEL).fingerprint())
    return {"step": loaded.step, "optimizer_steps": program.optimizer.steps, "loaded": _snapshot(program),
            "after": _steps(program, batches()[1:])}


def _case_build_from_checkpoint(root: str, mesh: Mesh, rank: int, world_size: int) -> dict:
    """A program built with ``weights=`` the checkpoint directory (``materialize``, no collective)."""
    return _snapshot(_program(mesh, weights=root))


# --------------------------------------------------------------------------- parent side


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_tp")
    tp_dir, dp_dir = str(root / "tp2"), str(root / "zero3")
    cases = {
        "save_tp": functools.partial(_case_save, tp_dir, TP2),
        "save_dp": functools.partial(_case_save, dp_dir, DP2),
        "tp_from_tp": functools.partial(_case_resume, tp_dir, TP2),
        "dp_from_tp": functools.partial(_case_resume, tp_dir, DP2),
        "tp_from_dp": functools.partial(_case_resume, dp_dir, TP2),
        "tp_built": functools.partial(_case_build_from_checkpoint, tp_dir, TP2),
    }
    return {"results": run_gloo_cases(cases, world_size=2, timeout_s=240), "tp": Path(tp_dir), "dp": Path(dp_dir),
            "root": root}


def _whole(per_rank: list[dict], mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every rank's masters and moments put together by ``ParamPlacement.regions``, under checkpoint keys."""
    out = {}
    for what in ("model", *MOMENTS):
        full = reassemble([{"shards": r[what], "placements": r["placements"], "coords": r["coords"]}
                           for r in per_rank], mesh)
        out.update({(f"model.{fqn}" if what == "model" else f"optim.{fqn}.{what}"): t for fqn, t in full.items()})
    return out


def _read_whole(path: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint at its global shape (DCP, no process group)."""
    import torch.distributed.checkpoint as dcp

    from autoshard.runtime._checkpoint_files import (
        SafeFileSystemReader, WeightsOnlyLoadPlanner, dtype_from_name, read_metadata_safely,
    )

    info = ckpt.read_info(path)
    full = {key: torch.empty(r.shape, dtype=dtype_from_name(r.dtype)) for key, r in info.tensors.items()
            if key.startswith(("model.", "optim."))}
    dcp.load(full, storage_reader=SafeFileSystemReader(path, read_metadata_safely(path)),
             planner=WeightsOnlyLoadPlanner(), no_dist=True)
    return full


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_fused_shard_blocks_are_the_placement_regions():
    """``held_indices`` (DTensor's rule on the placements) gives the blocks ``ParamPlacement.regions`` says, in
    local order: tp 2 alone, and tp 2 × ZeRO-3 dp 2 (the bias stays whole over dp; the weight splits rows)."""
    for mesh in (TP2, Mesh(dp_shard=2, tp=2)):
        for rank in range(mesh.world_size):
            ctx = RankContext(rank=rank, world_size=mesh.world_size, mesh=mesh, coords=coords_of(rank, mesh))
            coordinate = tuple(ctx.coords.values())
            for shape, layout in (((64, 192), TpLayout(transposed=True, parts=3)), ((192,), TpLayout(parts=3))):
                placement = placement_for("c_attn", shape, "column", LayerStrategy("h.0", state="zero3", tp="megatron"),
                                          ctx, layout=layout)
                held = held_indices(shape, placement.placements, tuple(getattr(mesh, a) for a in ctx.coords),
                                    coordinate)
                regions = placement.regions(ctx)  # joined along tp_dim; one range on every other dim
                expected = [[i for region in regions for i in range(region[d].start, region[d].stop)]
                            if d == placement.tp_dim else list(range(regions[0][d].start, regions[0][d].stop))
                            for d in range(len(shape))]
                assert held == expected, (mesh, rank, shape)


@pytest.mark.slow
def test_the_tp_run_holds_c_attn_as_three_parts(job):
    saved = job["results"]["save_tp"][0]["saved"]["placements"]
    assert saved[FUSED].tp_parts == 3  # the layout under test


@pytest.mark.slow
def test_tp_checkpoint_holds_the_global_tensors(job):
    """The tp 2 checkpoint holds the global masters and moments (fused c_attn included), as the ZeRO-3 one
    does: same keys, shapes and dtypes, so the format does not depend on the plan."""
    results = job["results"]
    _assert_equal(_read_whole(job["tp"]), _whole([r["saved"] for r in results["save_tp"]], TP2))
    _assert_equal(_read_whole(job["dp"]), _whole([r["saved"] for r in results["save_dp"]], DP2))
    tp, dp = ckpt.read_info(job["tp"]), ckpt.read_info(job["dp"])
    assert {k: v for k, v in tp.tensors.items() if not k.startswith("rng.")} == \
        {k: v for k, v in dp.tensors.items() if not k.startswith("rng.")}
    assert tp.tensors[f"optim.{FUSED}.exp_avg"].shape == (64, 192)
    from autoshard.runtime._checkpoint_files import read_metadata_safely

    chunks = read_metadata_safely(job["tp"]).state_dict_metadata[f"model.{FUSED}"].chunks
    # [q | k | v] of 64 columns each, 32 per rank: one chunk per block (rank 0: 0, 64, 128; rank 1: 32, 96, 160)
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [((0, 32 * k), (64, 32)) for k in range(6)]


@pytest.mark.slow
def test_same_plan_resume_is_bit_identical(job):
    results = job["results"]
    for resumed, saved in zip(results["tp_from_tp"], results["save_tp"]):
        assert resumed["step"] == 1 and resumed["optimizer_steps"] == 1
        assert resumed["after"] == saved["after"]  # exact floats
    _assert_equal(_whole([r["loaded"] for r in results["tp_from_tp"]], TP2),
                  _whole([r["saved"] for r in results["save_tp"]], TP2))


@pytest.mark.parametrize("case, saved, mesh", [("dp_from_tp", "save_tp", DP2), ("tp_from_dp", "save_dp", TP2)])
@pytest.mark.slow
def test_resume_under_the_other_plan(job, case, saved, mesh):
    """tp 2 → ZeRO-3 dp 2 and back: the loaded masters and moments are the checkpoint's, bit for bit; the next
    two losses equal the uninterrupted run's to rtol 1e-5 (reductions differ in order)."""
    results = job["results"]
    source = job["tp"] if saved == "save_tp" else job["dp"]
    _assert_equal(_whole([r["loaded"] for r in results[case]], mesh), _read_whole(source))
    for resumed in results[case]:
        torch.testing.assert_close(torch.tensor(resumed["after"], dtype=torch.float64),
                                   torch.tensor(results[saved][0]["after"], dtype=torch.float64), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_program_built_from_the_tp_checkpoint_reads_fused_blocks(job):
    whole = _whole(job["results"]["tp_built"], TP2)
    saved = _read_whole(job["tp"])
    for key, value in whole.items():
        if key.startswith("model."):
            assert torch.equal(value, saved[key]), key


@pytest.mark.slow
def test_export_of_the_tp_checkpoint_is_gpt2_with_hf_names(job):
    from autoshard.runtime.hf_export import export_checkpoint, hf_name_map

    config = config_of(MODEL)
    out = job["root"] / "hf"
    export_checkpoint(job["tp"], out, config=config)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out)
    params, to_hf = dict(hf.named_parameters()), hf_name_map(config)
    saved = {k.removeprefix("model."): v for k, v in _read_whole(job["tp"]).items() if k.startswith("model.")}
    trunk = {fqn: t for fqn, t in saved.items() if not fqn.startswith("value_head.")}
    assert to_hf(FUSED) == "transformer.h.0.attn.c_attn.weight"
    assert len(params) == len(trunk)  # lm_head is tied to wte: held once on both sides
    for fqn, tensor in trunk.items():
        assert torch.equal(params[to_hf(fqn)].detach(), tensor), fqn
