"""Pass ``split_pipeline``: stage submodules at the plan's boundaries (pp > 1) — not implemented yet.

Pre-conditions: ``insert_collectives`` ran. Post-conditions: with ``mesh.pp == 1``
the module is returned unchanged (one stage). With ``pp > 1`` it raises
``PlanError`` naming what is missing: splitting the graph into stage
submodules and driving them with ``torch.distributed.pipelining`` schedules
(GPipe / 1F1B / interleaved 1F1B).
"""

from __future__ import annotations

from torch import fx

from autoshard.errors import PlanError
from autoshard.passes.context import RankContext
from autoshard.plan import Plan

NAME = "split_pipeline"


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Identity for one stage; ``PlanError`` for pipeline parallelism (module docstring)."""
    if plan.mesh.pp > 1:
        raise PlanError(
            f"plan mesh has pp={plan.mesh.pp}: pipeline parallelism (stage split + {plan.schedule.name} schedule) "
            "is not implemented by the runtime yet; search with pp=1 (allowed now: pp in (1,))"
        )
    return gm
