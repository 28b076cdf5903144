"""Capture, part 7: why tensor parallelism cannot split a layer, known before any rank starts.

The runtime finds a layout it cannot split while it builds the program on each rank; capture
applies the same rules, on the exported graph, to every parameter with a tp role (column, row,
vocab) and records the first reason on the parameter's owner layer (``LayerInfo.tp_refusal``), so
``Plan.check_compatible`` refuses a forced tp plan of that layer with one line:

    unequal fused parts   a column projection whose output is split along its last dim into
                          parts of different widths (a fused grouped-query ``[q | k | v]``):
                          ``shard_parameters``' rule, the runtime's own function
    misused weight        a tp-split parameter used other than as a projection's weight or bias
                          or an embedding's table (``x @ W.t()``): ``_tp_dims.split_param_misuse``

The rules that depend on the tp degree (heads, key/value heads, FFN width and vocabulary
divisible by tp: MQA's one key/value head under any tp > 1) are checked by
``Plan.check_compatible`` against the counts capture records (``num_heads``, ``num_kv_heads``,
``ffn_hidden``, ``vocab``), as the search's ``tp_divides`` rules are. Not recorded here: what only
following the split dim through the graph finds (``_tp_dims.ShardDims``: a per-head attention
mask, a slice of the split dim, a reshape that mixes heads); the runtime refuses those while
building, before any step. The search keeps such a layer at tp = 'none' and the model without SP
(``search/space.py``, rules ``tp_runs/<reason>`` and ``sp_runs/tp_refusal``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from autoshard.passes._capture_export import Exported
from autoshard.passes._tp_dims import split_param_misuse
from autoshard.passes.shard_parameters import PROJECTIONS, _fused_parts

_SPLIT_ROLES = ("column", "row", "vocab")


def tp_refusals(exported: Exported, role_of: Callable[[str], str]) -> dict[str, str]:
    """Parameter fqn (of the exported module) → why tp cannot split it, for the parameters that have
    a reason (module docstring). ``role_of(fqn)`` is the parameter's tp role."""
    params = exported.program.graph_signature.inputs_to_parameters  # placeholder name → fqn
    out: dict[str, str] = {}
    for node in exported.program.graph.nodes:
        fqn = params.get(node.name) if node.op == "placeholder" else None
        if fqn is None or role_of(fqn) not in _SPLIT_ROLES:
            continue
        reason = _misuse(node, fqn) or (_unequal_parts(node, fqn) if role_of(fqn) == "column" else "")
        if reason:
            out[fqn] = reason
    return out


def _misuse(param: fx.Node, fqn: str) -> str:
    user = split_param_misuse(param)
    if user is None:
        return ""
    return f"tp-split parameter {fqn!r} is used by {user.name} ({user.target}), not as a projection's weight or bias"


def _unequal_parts(param: fx.Node, fqn: str) -> str:
    for user in param.users:
        weight_at = PROJECTIONS.get(user.target, (None,))[0]
        if weight_at is not None and weight_at < len(user.args) and user.args[weight_at] is param:
            parts = _fused_parts(user, fqn)  # the runtime's rule (passes/shard_parameters.py)
            if isinstance(parts, str):
                return parts
    return ""
