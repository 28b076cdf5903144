"""Shared cases of the runtime numerics tests: one spawned gloo job runs many plans.

Each case builds a per-rank program for a tiny reference model under a plan,
trains 3 SGD steps (fp32, 2 micro-batches, clipping on) and returns the losses
and the rank's fp32 local shards; the parent rebuilds full parameters from the
shards (``ParamPlacement``) and compares them and the losses with single-device
training. Equal parameters after SGD steps mean equal gradients.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.models import build
from autoshard.passes import capture
from autoshard.passes.context import chunk_size
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import BuildOptions, build_program
from autoshard.runtime.optimizer import OptimizerConfig
from autoshard.train import TrainSpec

OPT = OptimizerConfig(name="sgd", lr=0.5, max_grad_norm=1.0)
STEPS, MICRO, BATCH, SEQ = 3, 2, 8, 8


def loss_fn(out, tokens):
    logits, values = out
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return ce + values.pow(2).mean()


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


@functools.lru_cache(maxsize=None)
def graph_of(spec: str):
    """The captured graph, from a meta build (the same graph as a CPU build's, no op run: the gloo jobs'
    forkserver captures these once, ``_export_warm``)."""
    return capture(build(spec, device="meta"), seq_lens=(8, 16))


def make_plan(spec: str, mesh: Mesh, choose) -> Plan:
    """A plan with ``choose(layer_name) -> dict`` of strategy fields per layer."""
    graph = graph_of(spec)
    layers = tuple(LayerStrategy(layer=l.name, **choose(l.name)) for l in graph.layers)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=Schedule(num_micro_batches=MICRO))


def single_device(spec: str, builder=build, loss=None):
    """Losses and final parameters of plain single-device training (the reference); ``builder(spec)`` makes
    the model (default: a reference model), ``loss(outputs, tokens)`` scores it (default: ``loss_fn``)."""
    loss = loss or loss_fn
    model = builder(spec)
    params = [p for p in model.parameters()]
    losses = []
    for toks in batches():
        total = 0.0
        for chunk in toks.chunk(4, 0):  # dp=2 x micro=2 slices of 2 rows, same means as the sharded run
            value = loss(model(chunk), chunk) / 4
            value.backward()
            total += float(value.detach())
        torch.nn.utils.clip_grad_norm_(params, OPT.max_grad_norm)
        with torch.no_grad():
            for p in params:
                p -= OPT.lr * p.grad
                p.grad = None
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


class CountCollectives(TorchDispatchMode):
    """Counts ``autoshard::`` collective calls by op name."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "autoshard":
            name = func.__name__.split(".")[0]
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def train_case(rank, world_size, spec, graph, plan, count=False, precision="fp32", overlap_grad_sync=False,
               compile_graph=False, compile_regions="stem", compile_backend="inductor"):
    """Build, train STEPS steps; return losses, local shards, placements (and collective counts of step 1).

    The build options are ``build_program``'s defaults (gradient sync after backward, eager) unless a
    case asks for others (``tests/test_buckets.py`` and ``tests/test_compile_numerics.py`` overlap the sync).

    ``counts`` counts the ``autoshard::`` ops of step 1; ``overlap_launches`` the gradient buckets
    that step launched from backward (``runtime/optimizer.py``, overlapped sync), which are not ops.
    """
    model = build(spec)
    train = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision=precision)
    program = build_program(model, graph, plan, train, optimizer=OPT,
                            options=BuildOptions(overlap_grad_sync=overlap_grad_sync, compile=compile_graph,
                                                 regions=compile_regions, backend=compile_backend))
    losses, counts, launches = [], None, None
    for i, toks in enumerate(batches()):
        if count and i == 0:
            with CountCollectives() as counter:
                losses.append(program.step(program.local_batch(toks), loss_fn).loss)
            counts = counter.counts
        else:
            losses.append(program.step(program.local_batch(toks), loss_fn).loss)
        if i == 0:
            launches = program.optimizer.overlap_launches
    return {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
            "coords": program.ctx.coords, "counts": counts, "overlap_launches": launches,
            "compiled": program._run is not program.gm}


def reassemble(results: list[dict], mesh: Mesh) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's shards (tp pieces concatenated, ZeRO-3 chunks joined)."""
    full = {}
    for fqn, placement in results[0]["placements"].items():
        tp_pieces = []
        for t in range(mesh.tp):
            ranks = [r for r in results if r["coords"]["tp"] == t and r["coords"]["dp_replicate"] == 0 and r["coords"]["pp"] == 0]
            ranks.sort(key=lambda r: r["coords"]["dp_shard"])
            piece = torch.cat([r["shards"][fqn] for r in ranks], 0) if placement.dp_dim is not None else ranks[0]["shards"][fqn]
            tp_pieces.append(piece)
        full[fqn] = torch.cat(tp_pieces, placement.tp_dim) if placement.tp_dim is not None else tp_pieces[0]
    return full


def check_against_reference(results, reference, mesh, rtol=1e-5, atol=1e-6):
    ref_losses, ref_params = reference
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    full = reassemble(results, mesh)
    for fqn, value in full.items():
        torch.testing.assert_close(value, ref_params[fqn], rtol=rtol, atol=atol, msg=lambda m: f"{fqn}: {m}")


__all__ = ["check_against_reference", "chunk_size", "make_plan", "single_device", "train_case"]


class RecordGraphs:
    """A ``torch.compile`` backend: AOT autograd with inductor's partitioner; the forward and backward
    graphs are kept (``.forward``, ``.backward``) and run eager."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.forward, self.backward = [], []

        def keep(into):
            def compiler(gm, _inputs):
                into.append(gm)
                return make_boxed_func(gm.forward)
            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward),
                                    partition_fn=min_cut_rematerialization_partition)


def functional_ops(graphs) -> dict[str, int]:
    """Count of each ``_c10d_functional`` collective over ``graphs`` (a GraphModule or a list of them)."""
    counts: dict[str, int] = {}
    for gm in graphs if isinstance(graphs, (list, tuple)) else [graphs]:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "_c10d_functional" in str(node.target):
                name = str(node.target).split(".")[1]
                counts[name] = counts.get(name, 0) + 1
    return counts
