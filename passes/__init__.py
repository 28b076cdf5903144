"""Graph passes: capture, then the per-rank rewrites in the order ``PASSES`` lists them.

Each pass is ``run(gm, plan, ctx) -> gm`` (pure; pre/post-conditions in its
module docstring). ``quantize_comm`` runs after every pass that places collectives: it rewrites them.
``split_pipeline`` runs last: every other pass rewrites one flat graph; it cuts that graph into stages.
"""

from autoshard.passes import insert_collectives, recompute, schedule_overlap, shard_parameters, split_pipeline
from autoshard.passes import quantize_comm
from autoshard.passes.capture import capture

PASSES = (shard_parameters, insert_collectives, recompute, schedule_overlap, quantize_comm, split_pipeline)


def run_passes(gm, plan, ctx):
    """Apply every pass of ``PASSES`` in order; returns the per-rank module."""
    for p in PASSES:
        gm = p.run(gm, plan, ctx)
    return gm


__all__ = ["PASSES", "capture", "run_passes"]
