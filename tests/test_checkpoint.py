"""Checkpoints (runtime/checkpoint.py): resharding, atomic commit, weights-only loads.

Two spawned gloo jobs share one directory (module fixture ``jobs``): a 4-rank
job saves a ZeRO-3-like layout (Shard(0) over dp_shard=4, uneven and empty
shards included), fails a second save midway, and reloads into the runtime's
TP2×DP2 placements; a 2-rank job then loads the same checkpoint under
Shard(0) over 2 ranks. Everything else runs in this process without a
process group (DCP ``no_dist``).
"""

from __future__ import annotations

import functools
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from _harness import run_gloo_cases
from autoshard.plan import LayerStrategy, Mesh, Plan
from autoshard.runtime import checkpoint as ckpt
from autoshard.runtime._checkpoint_files import SafeFileSystemReader, WeightsOnlyLoadPlanner

FINGERPRINT = "sha256:model-a"
# name -> global shape; the 4-way Shard(0) splits are uneven (3,3,3,1) and (2,2,1,0).
SHAPES = {"emb.weight": (10, 6), "blk.w": (8, 4), "blk.b": (5,)}
REPLICATED = {"norm.g": (6,)}


def _globals() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    shapes = {**SHAPES, **REPLICATED}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _plan(mesh: Mesh) -> Plan:
    return Plan(model_name="toy", mesh=mesh, layers=(LayerStrategy("emb"), LayerStrategy("blk")))


def _local_of(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's DTensor chunk of ``full`` (computed locally, no collective)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, list(placements))
    local = full
    for dim, (size, start) in enumerate(zip(shape, offset)):
        local = local.narrow(dim, start, size)
    return local.clone()


def _state(mesh, placements_of, values, *, step=0, fingerprint=FINGERPRINT, plan=None, extras=None):
    """A CheckpointState with model + optimizer (master, exp_avg, step) cut by ``placements_of(name)``."""
    model, optim = {}, {}
    for name, full in values.items():
        if name in REPLICATED:
            model[name] = full.clone()
            continue
        placements = placements_of(name)
        cut = lambda t: ckpt.LocalShard(_local_of(t, mesh, placements), tuple(placements), tuple(t.shape))  # noqa: E731
        model[name] = cut(full)
        optim[name] = {"master": cut(full.double()), "exp_avg": cut(full * 0.1), "step": torch.tensor(3.0)}
    return ckpt.CheckpointState(
        model=model, optimizer=optim, step=step, extras=extras or {}, mesh=mesh,
        model_fingerprint=fingerprint, plan=plan,
    )


def _zeroed(state: ckpt.CheckpointState, **changes) -> ckpt.CheckpointState:
    """The same layout with every tensor zeroed: a load template."""
    def zero(entry):
        if isinstance(entry, ckpt.LocalShard):
            return ckpt.LocalShard(torch.zeros_like(entry.local), entry.placements, entry.global_shape)
        return torch.zeros_like(entry)

    from dataclasses import replace

    model = {k: zero(v) for k, v in state.model.items()}
    optim = {k: {n: zero(v) for n, v in s.items()} for k, s in state.optimizer.items()}
    return replace(state, model=model, optimizer=optim, step=0, extras={}, **changes)


def _matches(state: ckpt.CheckpointState, expected: ckpt.CheckpointState) -> dict[str, bool]:
    """Per key: the loaded local tensor equals this rank's chunk of the global tensor."""
    wanted = expected.tensor_entries()
    out = {}
    for key, entry in state.tensor_entries().items():
        got = entry.local if isinstance(entry, ckpt.LocalShard) else entry
        want = wanted[key].local if isinstance(entry, ckpt.LocalShard) else wanted[key]
        out[key] = got.dtype == want.dtype and torch.equal(got, want)
    return out


# --------------------------------------------------------------------------- 4-rank job


def _case_save_zero3(root: str, rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    state = _state(mesh, lambda name: (Shard(0),), _globals(), step=11,
                   plan=_plan(Mesh(dp_shard=4)), extras={"ppo": {"episodes": 5}})
    torch.manual_seed(1000 + rank)
    ckpt.save(Path(root) / "ckpt", state)
    after = torch.rand(3)  # continues from the saved RNG state
    local_shapes = {k: tuple(v.local.shape) for k, v in state.model.items() if isinstance(v, ckpt.LocalShard)}
    return {"rand_after_save": after, "local_shapes": local_shapes}


def _failing_write(self, plan, planner):
    raise OSError("disk died mid-save")


def _case_failed_save(root: str, rank: int, world_size: int):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    newer = {k: v + 100 for k, v in _globals().items()}
    state = _state(mesh, lambda name: (Shard(0),), newer, step=12)
    original = FileSystemWriter.write_data
    if rank == 1:
        FileSystemWriter.write_data = _failing_write
    try:
        ckpt.save(Path(root) / "ckpt", state)
        raised = None
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException(BaseException)
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        FileSystemWriter.write_data = original
    dist.barrier()  # rank 0 has removed the temporary directory
    return {"raised": raised, "listing": sorted(os.listdir(root)), "step": ckpt.read_info(Path(root) / "ckpt").step}


def _case_bad_local_shape(root: str, rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    bad = ckpt.LocalShard(torch.zeros(4, 6), (Shard(0),), (10, 6))  # a 4-way chunk of 10 rows is 3 (or 1)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.save(Path(root) / "other", ckpt.CheckpointState(model={"emb.weight": bad}, mesh=mesh))
    return str(err.value)


def _runtime_placements(rank: int):
    """The runtime's TP2×DP2 placements (passes/context.py): vocab/column tp then ZeRO-3 over dp_shard."""
    from autoshard.passes.context import placement_for
    from autoshard.runtime.mesh import build_rank_context

    ctx, device_mesh = build_rank_context(Mesh(dp_shard=2, tp=2))
    roles = {"emb.weight": ("vocab", "megatron"), "blk.w": ("column", "megatron"), "blk.b": ("column", "none")}
    placements = {}
    for name, shape in SHAPES.items():
        role, tp = roles[name]
        strategy = LayerStrategy(name.split(".")[0], state="zero3", tp=tp)
        placements[name] = placement_for(name, shape, role, strategy, ctx)
    return ctx, device_mesh, placements


def _case_load_tp2dp2(root: str, rank: int, world_size: int):
    ctx, device_mesh, placements = _runtime_placements(rank)
    expected = _state(device_mesh, lambda name: placements[name].placements, _globals(), step=11)
    for name, placement in placements.items():  # the runtime's own shard rule agrees with the expectation
        assert torch.equal(expected.model[name].local, placement.shard(_globals()[name], ctx)), name
    loaded = ckpt.load(Path(root) / "ckpt", _zeroed(expected))
    return {
        "matches": _matches(loaded, expected),
        "step": loaded.step,
        "extras": loaded.extras,
        "rand_after_load": torch.rand(3),
        "placements": {k: str(v.placements) for k, v in placements.items()},
    }


def _case_fingerprint_mismatch(root: str, rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    template = _zeroed(_state(mesh, lambda name: (Shard(0),), _globals()), model_fingerprint="sha256:model-b")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(Path(root) / "ckpt", template)
    alive = torch.ones(1)
    dist.all_reduce(alive)  # every rank is still in lockstep: no collective was left half-done
    return {"message": str(err.value), "alive": alive.item()}


# --------------------------------------------------------------------------- 2-rank job


def _case_load_two_ranks(root: str, rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    expected = _state(mesh, lambda name: (Shard(0),), _globals())
    loaded = ckpt.load(Path(root) / "ckpt", _zeroed(expected))
    return {"matches": _matches(loaded, expected), "step": loaded.step, "rand_after_load": torch.rand(3)}


# --------------------------------------------------------------------------- runtime programs

PROGRAM_SPEC = "llama:tiny"


def _zero3(_layer):
    return {"state": "zero3"}


def _tp_zero3(_layer):
    return {"tp": "megatron", "state": "zero3"}


def _program(graph, mesh: Mesh, choose, optimizer=None):
    from _runtime_cases import BATCH, OPT, SEQ, make_plan

    from autoshard.models import build
    from autoshard.runtime.program import build_program
    from autoshard.train import TrainSpec

    plan = make_plan(PROGRAM_SPEC, mesh, choose)
    train = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32")
    return build_program(build(PROGRAM_SPEC), graph, plan, train, optimizer=optimizer or OPT)


def _case_program_save(root: str, graph, rank: int, world_size: int):
    """ZeRO-3 over dp_shard=4: one SGD step, then save (the test compares resumed runs with single-device training)."""
    from _runtime_cases import batches, loss_fn

    program = _program(graph, Mesh(dp_shard=4), _zero3)
    loss = program.step(program.local_batch(batches()[0]), loss_fn).loss
    ckpt.save(Path(root) / "program", ckpt.program_state(program, step=1, model_fingerprint=graph.fingerprint()))
    return loss


def _case_program_resume(root: str, graph, mesh: Mesh, choose, rank: int, world_size: int):
    """A fresh program under another plan/world size resumes from the checkpoint: the next two losses."""
    from _runtime_cases import batches, loss_fn

    program = _program(graph, mesh, choose)
    loaded = ckpt.load_program(Path(root) / "program", program, model_fingerprint=graph.fingerprint())
    losses = [program.step(program.local_batch(tokens), loss_fn).loss for tokens in batches()[1:]]
    return {"step": loaded.step, "optimizer_steps": program.optimizer.steps, "losses": losses}


def _case_adamw_from_sgd_checkpoint(root: str, graph, rank: int, world_size: int):
    """An AdamW program loads the SGD checkpoint (no moments saved): weights, fresh moments, step 0."""
    from autoshard.runtime.optimizer import OptimizerConfig

    program = _program(graph, Mesh(dp_shard=2), _zero3, OptimizerConfig(name="adamw"))
    loaded = ckpt.load_program(Path(root) / "program", program, model_fingerprint=graph.fingerprint())
    moments = program.optimizer.local_moments()
    return {"step": loaded.step, "optimizer_steps": program.optimizer.steps,
            "moments_zero": all(not t.any() for states in moments.values() for t in states.values()),
            "saved_optimizer_steps": loaded.extras["optimizer_steps"]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    from _runtime_cases import graph_of

    root = str(tmp_path_factory.mktemp("ckpt_jobs"))
    graph = graph_of(PROGRAM_SPEC)
    four = run_gloo_cases(
        {
            "save": functools.partial(_case_save_zero3, root),
            "failed_save": functools.partial(_case_failed_save, root),
            "bad_local_shape": functools.partial(_case_bad_local_shape, root),
            "load_tp2dp2": functools.partial(_case_load_tp2dp2, root),
            "fingerprint": functools.partial(_case_fingerprint_mismatch, root),
            "program_save": functools.partial(_case_program_save, root, graph),
            "program_tp2dp2": functools.partial(_case_program_resume, root, graph, Mesh(dp_shard=2, tp=2), _tp_zero3),
        },
        world_size=4,
        timeout_s=180,
    )
    two = run_gloo_cases(
        {
            "load": functools.partial(_case_load_two_ranks, root),
            "program_dp2": functools.partial(_case_program_resume, root, graph, Mesh(dp_shard=2), _zero3),
            "adamw_from_sgd": functools.partial(_case_adamw_from_sgd_checkpoint, root, graph),
        },
        world_size=2,
        timeout_s=90,
    )
    return {"root": Path(root), "four": four, "two": two}


@pytest.mark.slow
def test_zero3_save_cuts_uneven_and_empty_shards(jobs):
    shapes = [r["local_shapes"] for r in jobs["four"]["save"]]
    assert [s["emb.weight"] for s in shapes] == [(3, 6), (3, 6), (3, 6), (1, 6)]
    assert [s["blk.b"] for s in shapes] == [(2,), (2,), (1,), (0,)]


@pytest.mark.slow
def test_failed_save_leaves_previous_checkpoint(jobs):
    for result in jobs["four"]["failed_save"]:
        assert result["raised"] is not None and "disk died" in result["raised"]
        assert result["listing"] == ["ckpt"]  # no temporary directory left behind
        assert result["step"] == 11


@pytest.mark.slow
def test_local_shape_breaking_chunk_rule_is_refused(jobs):
    for message in jobs["four"]["bad_local_shape"]:
        assert "'model.emb.weight'" in message and "[4, 6]" in message


@pytest.mark.slow
def test_reshard_zero3_to_tp2_dp2(jobs):
    for rank, result in enumerate(jobs["four"]["load_tp2dp2"]):
        assert result["matches"] and all(result["matches"].values()), (rank, result["matches"])
        assert set(result["matches"]) >= {"model.emb.weight", "optim.blk.w.master", "optim.blk.w.exp_avg"}
        assert result["step"] == 11 and result["extras"] == {"ppo": {"episodes": 5}}
    assert "_StridedShard" in jobs["four"]["load_tp2dp2"][0]["placements"]["blk.w"]


@pytest.mark.slow
def test_reshard_to_two_ranks(jobs):
    for result in jobs["two"]["load"]:
        assert all(result["matches"].values()), result["matches"]
        assert result["step"] == 11


@pytest.mark.slow
def test_rng_restored_per_rank(jobs):
    saved = [r["rand_after_save"] for r in jobs["four"]["save"]]
    assert not torch.equal(saved[0], saved[1])  # ranks had different streams
    for rank, result in enumerate(jobs["four"]["load_tp2dp2"]):
        assert torch.equal(result["rand_after_load"], saved[rank])
    for rank, result in enumerate(jobs["two"]["load"]):
        assert torch.equal(result["rand_after_load"], saved[rank])


@pytest.mark.slow
def test_fingerprint_mismatch_names_both_and_leaves_ranks_in_step(jobs):
    for result in jobs["four"]["fingerprint"]:
        assert FINGERPRINT in result["message"] and "sha256:model-b" in result["message"]
        assert result["alive"] == 4.0


@pytest.mark.slow
def test_sidecar_is_json_with_plan_and_mesh(jobs):
    info = ckpt.read_info(jobs["root"] / "ckpt")
    raw = json.loads((jobs["root"] / "ckpt" / ckpt.SIDECAR).read_text())
    assert raw["format"] == "autoshard.checkpoint" and info.world_size == 4 and info.mesh == {"dp_shard": 4}
    assert Plan.from_dict(info.plan).mesh == Mesh(dp_shard=4)
    assert info.tensors["model.emb.weight"].shape == (10, 6)
    assert info.tensors["optim.emb.weight.master"].dtype == "float64"
    assert {f"rng.cpu.{r}" for r in range(4)} <= set(info.tensors)


@pytest.mark.slow
def test_load_weights_and_safetensors_of_sharded_checkpoint(jobs, tmp_path):
    from safetensors.torch import load_file

    weights = ckpt.load_weights(jobs["root"] / "ckpt")
    expected = _globals()
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    out = ckpt.export_safetensors(jobs["root"] / "ckpt", tmp_path / "model.safetensors")
    exported = load_file(str(out))
    assert all(torch.equal(exported[name], tensor) for name, tensor in expected.items())


@pytest.mark.slow
def test_resumed_program_gives_identical_next_losses(jobs):
    """Resumed under TP2×DP2 (4 ranks) and ZeRO-3 over 2 ranks, the next two SGD losses equal
    single-device training from the same initialisation (the saved step-1 state is exact)."""
    from _runtime_cases import single_device

    losses = single_device(PROGRAM_SPEC)[0]
    for saved in jobs["four"]["program_save"]:
        assert saved == pytest.approx(losses[0], rel=1e-5)
    reference = losses[1:]
    for result in jobs["four"]["program_tp2dp2"] + jobs["two"]["program_dp2"]:
        assert result["step"] == 1 and result["optimizer_steps"] == 3  # 1 restored + 2 taken
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_adamw_program_loads_a_checkpoint_without_moments(jobs):
    for result in jobs["two"]["adamw_from_sgd"]:
        assert result == {"step": 1, "optimizer_steps": 0, "moments_zero": True, "saved_optimizer_steps": 1}


# --------------------------------------------------------------------------- one process


def _plain_state(step=7, fingerprint=FINGERPRINT, scale=1.0):
    values = _globals()
    return ckpt.CheckpointState(
        model={k: v * scale for k, v in values.items()},
        optimizer={"blk.w": {"exp_avg": values["blk.w"] * 0.5}},
        step=step,
        extras={"kl_coef": 0.02},
        model_fingerprint=fingerprint,
    )


def _plain_template(fingerprint=FINGERPRINT):
    return ckpt.CheckpointState(
        model={k: torch.zeros_like(v) for k, v in _globals().items()},
        optimizer={"blk.w": {"exp_avg": torch.zeros(SHAPES["blk.w"])}},
        model_fingerprint=fingerprint,
    )


def test_single_process_round_trip_and_replace(tmp_path):
    path = ckpt.save(tmp_path / "c", _plain_state(step=7))
    ckpt.save(tmp_path / "c", _plain_state(step=8, scale=2.0))  # replaces the committed one
    assert sorted(os.listdir(tmp_path)) == ["c"]
    loaded = ckpt.load(path, _plain_template())
    assert loaded.step == 8 and loaded.extras == {"kl_coef": 0.02}
    assert torch.equal(loaded.model["blk.w"], _globals()["blk.w"] * 2.0)
    assert torch.equal(loaded.optimizer["blk.w"]["exp_avg"], _globals()["blk.w"] * 0.5)


def test_fingerprint_mismatch_is_refused_before_dcp(tmp_path, monkeypatch):
    path = ckpt.save(tmp_path / "c", _plain_state())

    def no_collectives(*args, **kwargs):
        raise AssertionError("dcp.load ran before the fingerprint check")

    monkeypatch.setattr(ckpt.dcp, "load", no_collectives)
    with pytest.raises(ckpt.CheckpointError, match="sha256:model-a.*sha256:other"):
        ckpt.load(path, _plain_template(fingerprint="sha256:other"))
    with pytest.raises(ckpt.CheckpointError, match="sha256:other"):
        ckpt.load_weights(path, model_fingerprint="sha256:other")


def test_template_mismatches_name_the_key(tmp_path):
    path = ckpt.save(tmp_path / "c", _plain_state())
    missing = ckpt.CheckpointState(model={"nope.weight": torch.zeros(2)})
    with pytest.raises(ckpt.CheckpointError, match="'model.nope.weight' is not in checkpoint"):
        ckpt.load(path, missing)
    wrong = ckpt.CheckpointState(model={"blk.w": torch.zeros(8, 5)})
    with pytest.raises(ckpt.CheckpointError, match=r"'model.blk.w'.*\[8, 4\].*\[8, 5\]"):
        ckpt.load(path, wrong)


def test_killed_between_renames_and_interrupted_saves(tmp_path):
    path = ckpt.save(tmp_path / "c", _plain_state(step=3))
    os.rename(path, tmp_path / "c.old-deadbeef")  # the state a kill between the two renames leaves
    assert ckpt.load(path, _plain_template()).step == 3
    os.rename(tmp_path / "c.old-deadbeef", tmp_path / "c.tmp-deadbeef")
    (tmp_path / "c.tmp-deadbeef" / ckpt.SIDECAR).unlink()  # a save killed before its commit
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint at .*incomplete saves found: \['c.tmp-deadbeef'\]"):
        ckpt.load(path, _plain_template())
    ckpt.save(path, _plain_state(step=4))  # the next save sweeps the leftovers
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_save_refuses_foreign_directory_and_non_json_extras(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="exists and is not an autoshard checkpoint"):
        ckpt.save(tmp_path / "data", _plain_state())
    from dataclasses import replace

    with pytest.raises(ckpt.CheckpointError, match="not JSON data"):
        ckpt.save(tmp_path / "c", replace(_plain_state(), extras={"t": torch.zeros(1)}))


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_crafted_metadata_is_not_unpickled(tmp_path, monkeypatch):
    path = ckpt.save(tmp_path / "c", _plain_state())
    (path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="posix.system|os.system"):
        ckpt.load_weights(path)
    assert not (tmp_path / "PWNED").exists()


def test_pickled_entries_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    dcp.save({"obj": {"a": [1, 2]}, "x": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    # DCP wraps errors raised inside its phases in CheckpointException (a BaseException).
    with pytest.raises(CheckpointException, match="'obj.a' is a pickled object"):
        dcp.load({"obj": {"a": None}}, storage_reader=SafeFileSystemReader(tmp_path),
                 planner=WeightsOnlyLoadPlanner(), no_dist=True)


def test_safe_reader_reads_real_metadata(tmp_path):
    path = ckpt.save(tmp_path / "c", _plain_state())
    metadata = SafeFileSystemReader(path).read_metadata()
    assert tuple(metadata.state_dict_metadata["model.blk.w"].size) == SHAPES["blk.w"]
    assert metadata.storage_meta is not None
