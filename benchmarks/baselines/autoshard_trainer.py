"""autoshard's own trainer for the benchmark: a ``Plan`` run by ``build_program``, same step as the baselines.

``plan_constraints(graph, precision)`` pins the family ``--plans best`` searches
(and the defaults forced variants start from, ``baselines/plans.py``): one
pipeline stage, no context or expert parallelism, no recompute, no sequence
parallelism, uncompressed communication. The runtime executes more than this
(pp, recompute, SP, EP, quantized comm: docs/runtime.md); forced variants free
or fix those fields one at a time, so the best plan stays comparable with the
first GPU runs. Every layer class gets the same pin. ``grad_comm="bf16"`` is
the strategy space's only uncompressed choice on every mesh (``"fp32"`` is
offered only with dp > 1), so an fp32 run (the CPU smoke test) is priced with
2-byte gradient collectives while it moves 4-byte ones: a known
under-estimate there, none in bf16 runs. ``uniform_plan`` writes a hand-made plan (one
state for every layer, optional Megatron TP) for the baselines' "equivalent
plan" predictions and the numerics test.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from autoshard.graph import ModelGraph
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.train import TrainSpec
from benchmarks.baselines.common import RunSpec, policy_loss, reference_model

RUNTIME_MESH = {"pp": 1, "cp": 1, "ep": 1}


def train_spec(spec: RunSpec, *, micro_batch: int | None = None) -> TrainSpec:
    """The ``TrainSpec`` of a benchmark run (optimizer name and precision from ``spec``)."""
    return TrainSpec(global_batch=spec.global_batch, seq_len=spec.seq_len, micro_batch=micro_batch,
                     optimizer=spec.optimizer.name, precision=spec.precision)


def runtime_pin(precision: str, **fields: Any) -> dict[str, Any]:
    """The per-class pin keeping a searched plan inside what the runtime runs (module docstring)."""
    del precision  # see the module docstring: "bf16" names uncompressed communication in the strategy space
    return {"recompute": "none", "sp": False, "weight_comm": "bf16", "grad_comm": "bf16", **fields}


def plan_constraints(graph: ModelGraph, precision: str, *, mesh: dict[str, int] | None = None,
                     **fields: Any):
    """``Constraints`` pinning every layer class with ``runtime_pin`` (+ ``fields``) on ``RUNTIME_MESH`` (+ ``mesh``)."""
    from autoshard.search import Constraints

    pin = {class_id: runtime_pin(precision, **fields) for class_id in sorted({l.class_id for l in graph.layers})}
    return Constraints(mesh={**RUNTIME_MESH, **(mesh or {})}, pin=pin)


def uniform_plan(graph: ModelGraph, mesh: Mesh, *, state: str, tp: bool = False, num_micro_batches: int = 1,
                 global_batch: int = 1, seq_len: int = 1, precision: str = "bf16", optimizer: str = "adamw") -> Plan:
    """A plan with ``state`` on every layer and Megatron TP on every tp-able layer when ``tp``."""
    from autoshard.search.space import is_tp_able

    layers = tuple(
        LayerStrategy(layer=layer.name, state=state, tp="megatron" if tp and is_tp_able(layer) else "none")
        for layer in graph.layers
    )
    micro_batch = max(1, global_batch // (mesh.dp * num_micro_batches))
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, global_batch=global_batch, seq_len=seq_len,
                precision=precision, optimizer=optimizer,
                schedule=Schedule(micro_batch=micro_batch, num_micro_batches=num_micro_batches))


class AutoshardTrainer:
    """``build_program`` for ``plan``; ``step`` cuts this rank's dp slice and calls ``Program.step``."""

    def __init__(self, spec: RunSpec, device: torch.device, graph: ModelGraph, plan: Plan, cluster: Any = None, *,
                 name: str = "autoshard"):
        from autoshard.runtime import BuildOptions, build_program

        self.name, self.plan, self.device = name, plan, device
        model = reference_model(spec, device)
        train = train_spec(spec, micro_batch=plan.schedule.micro_batch)
        # AUTOSHARD_OVERLAP_GRAD_SYNC=1: DP gradient buckets under backward (off by default; A/B measurements)
        overlap = os.environ.get("AUTOSHARD_OVERLAP_GRAD_SYNC", "0") == "1"
        # AUTOSHARD_COMPILE: auto (default: torch.compile the per-rank graph on CUDA when ep = cp = 1,
        # build_program's default), 1 (always), 0 (eager)
        compile_graph = {"0": False, "1": True}.get(os.environ.get("AUTOSHARD_COMPILE", "auto"), "auto")
        # AUTOSHARD_COMPILE_REGIONS: stem (default), block or graph (runtime/compile_regions.py)
        regions = os.environ.get("AUTOSHARD_COMPILE_REGIONS", "stem")
        # AUTOSHARD_COMPILE_OVERLAP: scheduler, reorder or none (passes/schedule_overlap.py; A/B runs)
        overlap_mode = os.environ.get("AUTOSHARD_COMPILE_OVERLAP") or "plan"
        self.program = build_program(model, graph, plan, train, optimizer=spec.optimizer,
                                     device=str(device),
                                     options=BuildOptions(overlap_grad_sync=overlap, compile=compile_graph, regions=regions,
                                                          overlap=overlap_mode))
        # AUTOSHARD_GATHER_UNDER_UPDATE=0: update every slot, then all-gather (runtime/optimizer.py; A/B runs)
        self.program.optimizer.gather_under_update = os.environ.get("AUTOSHARD_GATHER_UNDER_UPDATE", "1") == "1"
        self.last_grad_norm = float("nan")

    def step(self, global_tokens: torch.Tensor) -> float:
        """``Program.step`` on this rank's data-parallel slice (loss averaged over dp by the program)."""
        result = self.program.step(self.program.local_batch(global_tokens), policy_loss)
        self.last_grad_norm = result.grad_norm
        return result.loss

    def local_state(self) -> dict[str, torch.Tensor]:
        """fp32 master shards at each parameter's placement (collective for flat ZeRO states)."""
        return self.program.local_state_dict()

    def close(self) -> None:
        """Drop the program (its device mesh's groups live until the process group is destroyed)."""
        del self.program


__all__ = ["RUNTIME_MESH", "AutoshardTrainer", "plan_constraints", "runtime_pin", "train_spec", "uniform_plan"]
