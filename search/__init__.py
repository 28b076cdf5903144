"""Search: cost model, strategy space, CP-SAT solver, explain and diff (docs/search.md).

Public entry points::

    from autoshard.search import solve, enumerate_meshes, explain_layer, diff_plans
"""

from autoshard.search.explain import diff_plans, explain_layer, format_diff, format_explanation
from autoshard.search.solver import solve, without_wall_time
from autoshard.search.space import Constraints, enumerate_meshes

__all__ = [
    "Constraints",
    "diff_plans",
    "enumerate_meshes",
    "explain_layer",
    "format_diff",
    "format_explanation",
    "solve",
    "without_wall_time",
]
