"""Pipeline schedule arithmetic: stage mapping, step time, bubble, in-flight micro-batches.

Notation: ``p`` pipeline ranks, ``m`` micro-batches per optimizer step, ``v``
virtual stages per rank (``interleaved_1f1b`` only, else 1), ``T_k`` the time
one micro-batch spends on pipeline rank ``k`` (forward + backward of all its
layers, tensor/expert-parallel comm on the critical path, and the stage-boundary
send/recv), ``T = max_k T_k``.

Step time of the pipelined part (Narayanan et al. 2021, §2.2):

    gpipe, 1f1b          (m + p − 1) · T          bubble (p − 1) · T
    interleaved_1f1b     (m + (p − 1)/v) · T      bubble (p − 1)/v · T

Stage boundary traffic: the declared ``stage_boundary_form`` (``autoshard/model_parallel.py``):
one activation forward and its gradient backward per micro-batch, ``b·s/cp · h`` in the training
precision (divided by tp when the layer before the boundary runs sequence-parallel), priced as
``send_recv`` (``cost_model.boundary_send_s``); interleaving crosses ``v`` times as many boundaries.

Micro-batches whose activations rank ``k`` holds at once (``in_flight``), in
units of the whole rank's activations for one micro-batch:

    gpipe                m (every forward runs before any backward)
    1f1b                 min(p − k, m)       (Korthikanti: the first stage holds p)
    interleaved_1f1b     min(m·v, 2·(p − k − 1) + (v − 1)·p + 1) / v
                         (Megatron-Core's warm-up count, in model chunks of
                         1/v of the rank's layers, plus the one in steady state;
                         ≈ p·(1 + 1/v)… p·(1 + (v−1)/v) on the first rank)

Stage ids: a layer's ``stage`` is its virtual stage; with interleaving it runs
on pipeline rank ``stage % p`` (Megatron-Core's layout), otherwise
``stage == rank``.
"""

from __future__ import annotations

from autoshard.errors import PlanError
from autoshard.plan import Schedule


def virtual_stages(schedule: Schedule) -> int:
    """v: model chunks per pipeline rank (1 unless ``interleaved_1f1b``)."""
    return schedule.virtual_stages if schedule.name == "interleaved_1f1b" else 1


def stage_rank(stage: int, pp: int, schedule: Schedule) -> int:
    """Pipeline rank that runs virtual stage ``stage``."""
    rank = stage % pp if virtual_stages(schedule) > 1 else stage
    if rank >= pp:
        raise PlanError(
            f"layer stage {stage} needs pipeline rank {rank} but mesh.pp={pp}: "
            f"stages must lie in [0, pp·virtual_stages); re-run the search or fix the plan's stages"
        )
    return rank


def pipeline_time(stage_time_s: float, pp: int, schedule: Schedule) -> tuple[float, float]:
    """(steady-state time m·T, bubble time) for the slowest rank's per-micro-batch time T."""
    m = schedule.num_micro_batches
    bubble = (pp - 1) / virtual_stages(schedule) * stage_time_s
    return m * stage_time_s, bubble


def in_flight(schedule: Schedule, pp: int, rank: int) -> float:
    """Micro-batches of activations pipeline rank ``rank`` holds at its peak (module docstring)."""
    m = schedule.num_micro_batches
    if pp == 1:
        return 1.0  # forward then backward of one micro-batch at a time (accumulation frees the rest)
    if schedule.name == "gpipe":
        return float(m)
    v = virtual_stages(schedule)
    if v == 1:
        return float(min(pp - rank, m))
    chunks = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1)
    return chunks / v


def interleaved_order(pp: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """``("F" | "B", local chunk, micro-batch)`` in the order pipeline rank ``rank`` runs them under the
    interleaved 1F1B schedule (Megatron-Core's, which ``torch.distributed.pipelining.ScheduleInterleaved1F1B``
    follows): ``min(m·v, (v − 1)·p + 2·(p − rank − 1))`` warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards. The j-th forward runs chunk ``(j mod p·v) // p`` of micro-batch
    ``(j // p·v)·p + j mod p``; the j-th backward the chunks in reverse. Needs ``m % p == 0``
    (``Schedule.admits``)."""
    total = m * v
    warmup = min(total, (v - 1) * pp + 2 * (pp - rank - 1))

    def op(kind: str, j: int) -> tuple[str, int, int]:
        chunk = (j % (pp * v)) // pp
        return kind, chunk if kind == "F" else v - 1 - chunk, (j // (pp * v)) * pp + j % pp

    order = [op("F", j) for j in range(warmup)]
    forward = warmup
    for backward in range(total):
        if forward < total:
            order.append(op("F", forward))
            forward += 1
        order.append(op("B", backward))
    return order


def boundary_crossings(schedule: Schedule) -> int:
    """Stage-boundary transfers each way per micro-batch on one rank (v with interleaving)."""
    return virtual_stages(schedule)
