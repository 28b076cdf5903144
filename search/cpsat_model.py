"""One CP-SAT model: strategies per layer class and stage boundaries for a fixed (mesh, schedule).

The math is written out in ``solver.py``'s module docstring; each constraint
family there names the function here that builds it. Units inside the model:
time in ``unit_s`` (chosen per solve so the largest time is ~1e8 units),
memory in KiB (rounded up, the cap rounded down, so rounding never admits an
over-budget plan).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from autoshard.plan import LayerStrategy, Mesh, Schedule
from autoshard.search.evaluate import Option, interleaved_block_stages
from autoshard.search.memory import gather_copies
from autoshard.search.pipeline import in_flight, virtual_stages
from autoshard.search.space import SolverClass, strategy_key

KIB = 1024


@dataclass(frozen=True)
class ModelInput:
    """Everything one CP-SAT model needs, already reduced to numbers."""

    classes: tuple[SolverClass, ...]
    options: tuple[tuple[Option, ...], ...]  # per class, dominance-pruned
    block_classes: tuple[tuple[int, ...], ...]  # per anchor block: solver-class index of each layer on it
    mesh: Mesh
    schedule: Schedule
    cap_bytes: int
    unit_s: float
    cutoff_s: float | None = None  # only solutions strictly better than this are wanted
    hint: tuple[LayerStrategy | None, ...] = ()  # per class
    hint_block_stage: tuple[int, ...] = ()
    block_chain: tuple[tuple[bool, ...], ...] = ()  # per anchor block, per layer: continues its block


@dataclass(frozen=True)
class ModelResult:
    """Decoded CP-SAT answer."""

    status: str
    choice: tuple[int, ...]  # per class: index into ModelInput.options[c]
    block_stage: tuple[int, ...]  # per anchor block: (virtual) stage
    objective_s: float
    bound_s: float


def _noise(key: str, modulo: int) -> int:
    """Deterministic tie-break weight (zlib.crc32, not the salted ``hash``)."""
    return zlib.crc32(key.encode()) % modulo


def _tie_weight(class_name: str, strategy: LayerStrategy, rank: int) -> int:
    """Tie-break weight: prefer the simpler strategy (earlier in canonical order: less sharding,
    less recompute, unquantized comm), then a deterministic hash so the optimum is unique."""
    return rank * 16 + _noise(f"{class_name}|{strategy_key(strategy)}", 16)


class _Builder:
    def __init__(self, inp: ModelInput) -> None:
        self.inp = inp
        self.model = cp_model.CpModel()
        self.pp = inp.mesh.pp
        self.v = virtual_stages(inp.schedule)
        self.num_blocks = len(inp.block_classes)
        # one micro-batch on one stage: gradients appear as the backward runs (memory.step_peak_bytes)
        self.grads_apart = self.pp == 1 and inp.schedule.num_micro_batches == 1

    # -- scaled coefficients ---------------------------------------------------------------
    def t(self, o: Option) -> int:
        return int(round(o.time_s / self.inp.unit_s))

    def tail(self, o: Option) -> int:
        return int(round(o.tail_s / self.inp.unit_s))

    def s(self, o: Option) -> int:
        return int(math.ceil(o.static_bytes / KIB))

    def a(self, o: Option) -> int:
        return int(math.ceil(o.activation_bytes / KIB))

    def g(self, o: Option) -> int:
        return int(math.ceil(o.buffer_bytes / KIB))

    def h(self, o: Option) -> int:
        return int(math.ceil(o.gathered_bytes / KIB))

    def gr(self, o: Option) -> int:
        return int(math.ceil(o.cost.memory.grads / KIB))

    def r(self, o: Option) -> int:
        return _kib(o.build_resident_bytes)

    def x_build(self, o: Option) -> int:
        return _kib(o.build_transient_bytes)

    def o_step(self, o: Option) -> int:
        return _kib(o.optimizer_step_bytes)

    def y_step(self, o: Option) -> int:
        return _kib(o.step_transient_bytes)

    def k_bucket(self, o: Option) -> int:
        return _kib(o.cost.memory.step_bucketed)

    def n_bucket(self, o: Option) -> int:
        return _kib(o.cost.memory.step_bucket_members)

    def a_chain(self, o: Option) -> int:
        return int(math.ceil(o.chain_bytes / KIB))

    def p2p(self, o: Option) -> int:
        return int(round(o.p2p_s / self.inp.unit_s))

    # -- buffer_max/<class>/stage<k>: G_k ≥ backward buffers of every class on rank k ------------
    # -- gathered_max/<class>/stage<k>: H_k ≥ forward gathered parameters of every class on rank k
    # -- build_max/<class>/stage<k>: X_k ≥ build transient of every class on rank k -------------
    # -- optstep_max/<class>/stage<k>: Y_k ≥ optimizer-step bucket copies of every class on rank k
    def add_buffer_max(self, build_rows: bool) -> None:
        """G_k, H_k, Y_k, and X_k with the build rows, per rank (evaluate.py: the per-rank maxima), and the
        live buffers L_k ≥ G_k, L_k ≥ (2 + prefetch)·H_k (``memory.live_buffers``: a max, convex)."""
        self.g_rank = self._rank_max(self.g, "G", "buffer_max")
        h_rank = self._rank_max(self.h, "H", "gathered_max")
        factor = gather_copies(self.inp.schedule.prefetch)
        hi = lambda coef: max((coef(o) for opts in self.inp.options for o in opts), default=0)  # noqa: E731
        self.live_rank = []
        for k, (g, h) in enumerate(zip(self.g_rank, h_rank)):
            live = self.model.new_int_var(0, max(hi(self.g), factor * hi(self.h)), f"L[{k}]")
            self.model.add(live >= g).with_name(f"live_buffers/stage{k}")
            self.model.add(live >= factor * h).with_name(f"live_buffers/stage{k}")
            self.live_rank.append(live)
        self.y_step_rank = self._rank_max(self.y_step, "Y", "optstep_max")
        self.x_rank = self._rank_max(self.x_build, "X", "build_max") if build_rows else None

    def _rank_max(self, coef, name: str, family: str) -> list[cp_model.IntVar]:
        """One variable per rank ≥ ``coef`` of every class on it. A class on every block bounds every
        rank's; one riding on some blocks only (embedding, head) bounds it where its block sits."""
        hi = max((coef(o) for opts in self.inp.options for o in opts), default=0)
        out = [self.model.new_int_var(0, hi, f"{name}[{k}]") for k in range(self.pp)]
        everywhere = set.intersection(*(set(m) for m in self.inp.block_classes)) if self.inp.block_classes else set()
        for c, cls in enumerate(self.inp.classes):
            expr = self.class_expr(c, coef)
            if c in everywhere or not self.inp.block_classes:
                for k, var in enumerate(out):
                    self.model.add(var >= expr).with_name(f"{family}/{cls.name}/stage{k}")
                continue
            for b, members in enumerate(self.inp.block_classes):
                if c not in members:
                    continue
                for k, lit in self.y[b].items():
                    row = self.model.add(out[k] >= expr).with_name(f"{family}/{cls.name}/stage{k}")
                    if lit is not True:
                        row.only_enforce_if(lit)
        return out

    # -- one_strategy/<class>, sp_consistent/<class> ----------------------------------------
    def add_strategy_choice(self) -> None:
        m, inp = self.model, self.inp
        self.x = [[m.new_bool_var(f"x[{c.name}][{i}]") for i in range(len(opts))]
                  for c, opts in zip(inp.classes, inp.options)]
        for c, xs in zip(inp.classes, self.x):
            m.add_exactly_one(xs).with_name(f"one_strategy/{c.name}")
        self.sp = m.new_bool_var("sp") if inp.mesh.tp > 1 else None
        if self.sp is not None:
            for c, xs, opts in zip(inp.classes, self.x, inp.options):
                m.add(sum(x for x, o in zip(xs, opts) if o.strategy.sp) == self.sp).with_name(f"sp_consistent/{c.name}")

    def class_expr(self, c: int, coef) -> cp_model.LinearExpr:
        return sum(coef(o) * x for o, x in zip(self.inp.options[c], self.x[c]))

    # -- per-block linear terms (one IntVar per distinct block composition): T, tail, S, A, R, Gr, O --
    def add_block_terms(self, build_rows: bool) -> None:
        self.block_terms: list[tuple] = []
        self.upper: dict[int, int] = {}
        self._full: dict[int, cp_model.IntVar] = {}
        self._chain_z: dict[tuple, cp_model.IntVar] = {}
        cache: dict[tuple, tuple] = {}
        chains = self.inp.block_chain or tuple((False,) * len(m) for m in self.inp.block_classes)
        for members, chain in zip(self.inp.block_classes, chains):
            key = (tuple(members), tuple(chain))
            if key not in cache:
                sorted_members = tuple(sorted(members))
                cache[key] = (self._block_var(sorted_members, self.t, "T"),
                              self._block_var(sorted_members, self.tail, "tail"),
                              self._block_var(sorted_members, self.s, "S"),
                              self._activation_var(tuple(members), tuple(chain)),
                              self._block_var(sorted_members, self.r, "R") if build_rows else None,
                              self._block_var(sorted_members, self.gr, "Gr") if self.grads_apart else None,
                              self._block_var(sorted_members, self.o_step, "O"),
                              self._block_var(sorted_members, self.k_bucket, "K"),
                              self._block_var(sorted_members, self.n_bucket, "N"))
            self.block_terms.append(cache[key])

    def _block_var(self, members: tuple[int, ...], coef, name: str) -> cp_model.IntVar:
        hi = sum(max(coef(o) for o in self.inp.options[c]) for c in members)
        lo = sum(min(coef(o) for o in self.inp.options[c]) for c in members)
        var = self.model.new_int_var(lo, hi, f"{name}{list(members)}")
        self.model.add(var == sum(self.class_expr(c, coef) for c in members))
        self.upper[var.index] = hi
        return var

    def _full_recompute(self, c: int) -> cp_model.LinearExpr:
        """1 iff class c runs full recompute."""
        return sum(x for o, x in zip(self.inp.options[c], self.x[c]) if o.full_recompute)

    def _member_activations(self, members: tuple[int, ...], chain: tuple[bool, ...]) -> list[cp_model.LinearExpr]:
        """A_l (or A'_l, evaluate.py) of each layer of a block composition, in order: a full-recompute layer
        whose predecessor in the block is full too holds A' instead of A. ``z ≤ x[c,s]``, ``z ≤ full(c_prev)``;
        the memory rows are upper bounds, so the optimum sets z to the product (``chain_region/<classes>``)."""
        out = []
        for i, c in enumerate(members):
            opts = self.inp.options[c]
            expr = [self.class_expr(c, self.a)]
            if chain[i]:
                prev = members[i - 1]
                for j, (o, x) in enumerate(zip(opts, self.x[c])):
                    saving = self.a(o) - self.a_chain(o)
                    if not o.full_recompute or saving <= 0 or not any(p.full_recompute for p in self.inp.options[prev]):
                        continue
                    key = (prev, c, j)
                    if key not in self._chain_z:
                        z = self.model.new_bool_var(f"z[{prev}>{c}][{j}]")
                        self.model.add(z <= x).with_name(f"chain_region/{self.inp.classes[c].name}")
                        self.model.add(z <= self._full_recompute(prev)).with_name(
                            f"chain_region/{self.inp.classes[c].name}")
                        self._chain_z[key] = z
                    expr.append(-saving * self._chain_z[key])
            out.append(sum(expr))
        return out

    def _activation_var(self, members: tuple[int, ...], chain: tuple[bool, ...]) -> cp_model.IntVar:
        """A_b with checkpoint regions: the sum of ``_member_activations``."""
        lo = hi = 0
        for i, c in enumerate(members):
            opts = self.inp.options[c]
            hi += max(self.a(o) for o in opts)
            lo += min(min(self.a(o), self.a_chain(o)) if chain[i] else self.a(o) for o in opts)
        var = self.model.new_int_var(lo, hi, f"A{list(members)}")
        self.model.add(var == sum(self._member_activations(members, chain)))
        self.upper[var.index] = hi
        return var

    # -- stage_assign/<block>, stage_contiguous/<block>, stage_first, stage_last ----------------
    def add_stage_assignment(self) -> None:
        """``self.y[b]``: stage → literal (``True`` when fixed). Contiguity as in the solver docstring."""
        B, p, m = self.num_blocks, self.pp, self.model
        if self.v > 1:
            fixed = interleaved_block_stages(B, p, self.v)
            self.y = [{fixed[b] % p: True} for b in range(B)]
            self.block_stage_fixed = fixed
            return
        self.block_stage_fixed = None
        self.y, self.st = [], []
        for b, (lo, hi) in enumerate(stage_windows(B, p)):
            if lo == hi:
                self.y.append({lo: True})
                self.st.append(lo)
                continue
            lits = {k: m.new_bool_var(f"y[{b}][{k}]") for k in range(lo, hi + 1)}
            m.add_exactly_one(lits.values()).with_name(f"stage_assign/{b}")
            st = m.new_int_var(lo, hi, f"st[{b}]")
            m.add(st == sum(k * lit for k, lit in lits.items())).with_name(f"stage_assign/{b}")
            self.y.append(lits)
            self.st.append(st)
        for b in range(B - 1):
            if isinstance(self.st[b], int) and isinstance(self.st[b + 1], int):
                continue  # both fixed by their windows, consistent by construction
            m.add(self.st[b] <= self.st[b + 1]).with_name(f"stage_contiguous/{b}")
            m.add(self.st[b + 1] <= self.st[b] + 1).with_name(f"stage_contiguous/{b}")

    def _rank_sum(self, k: int, term: int, scale_a: int = 0) -> cp_model.LinearExpr:
        """Σ_b [block b on rank k] · (term of b) (+ scale_a · A_b for memory rows)."""
        total = []
        for b, lits in enumerate(self.y):
            if k not in lits:
                continue
            terms = self.block_terms[b]
            value = terms[term] if not scale_a else terms[2] * self.v + scale_a * terms[3]
            lit = lits[k]
            if lit is True:
                total.append(value)
                continue
            hi = (self._ub(terms[term]) if not scale_a else self._ub(terms[2]) * self.v + scale_a * self._ub(terms[3]))
            w = self.model.new_int_var(0, hi, f"w{term}[{b}][{k}]")
            self.model.add(w >= value).only_enforce_if(lit)
            total.append(w)
        return sum(total)

    def _ub(self, var: cp_model.IntVar) -> int:
        return self.upper[var.index]

    # -- stage_time/stage<k>, mem/stage<k>, build/stage<k>, step/stage<k>, objective -------------
    def add_stage_rows_and_objective(self) -> None:
        inp, m, p, v = self.inp, self.model, self.pp, self.v
        p2p = self.stage_p2p()
        t_hi = sum(self._ub(terms[0]) for terms in self.block_terms) + max(hi for _, hi in p2p)
        self.t_max = m.new_int_var(0, t_hi, "T_max")
        tail_hi = sum(self._ub(terms[1]) for terms in self.block_terms)
        slots_v = inp.schedule.num_micro_batches * v + p - 1
        self.z = m.new_int_var(0, (slots_v * t_hi + v * tail_hi) // v + 1, "Z")
        cap_kib = inp.cap_bytes // KIB
        receive = self.stage_receive_buffers()
        for k in range(p):
            m.add(self.t_max >= self._rank_sum(k, 0) + p2p[k][0]).with_name(f"stage_time/stage{k}")
            flight_v = int(round(in_flight(inp.schedule, p, k) * v))
            if p == 1:  # one stage: the backward's timeline (memory.step_peak_bytes)
                self.add_timeline_rows(cap_kib, flight_v)
            else:
                m.add(self._rank_sum(k, 2, scale_a=flight_v) + v * self.live_rank[k] + v * receive[k]
                      <= cap_kib * v).with_name(f"mem/stage{k}")
            # The build peak (Σ R + max X) is not implied by mem/stage<k>: that row adds gradients,
            # buffers and activations to the same R, but X = 8 B × the largest region can exceed them
            # (DDP in bf16: 2 B of gradient per element against 8 B of transient for a layer that
            # is mostly one matrix; ZeRO-3 on one rank without prefetch: gΨ + (p + g)Ψ = 6Ψ < 8Ψ;
            # a layer inside a fully recomputed block keeps no activation), so it has its own row.
            if self.x_rank is not None:
                m.add(self._rank_sum(k, 4) + self.x_rank[k] <= cap_kib).with_name(f"build/stage{k}")
            # The optimizer step (Σ O + max Y: model states, the fp32 gradients it reads, a packed
            # bucket) is not implied by mem/stage<k> either: its gradient copies can exceed activations.
            m.add(self._rank_sum(k, 6) + self.rank_buckets(k) <= cap_kib).with_name(f"optstep/stage{k}")
            m.add(v * self.z >= slots_v * self.t_max + v * self._rank_sum(k, 1)).with_name(f"step/stage{k}")
        if inp.cutoff_s is not None:
            m.add(self.z <= max(int(math.floor(inp.cutoff_s / inp.unit_s)) - 1, 0)).with_name("cutoff")
        noise = [(_tie_weight(c.name, o.strategy, rank), x)
                 for c, opts, xs in zip(inp.classes, inp.options, self.x)
                 for rank, (o, x) in enumerate(sorted(zip(opts, xs), key=lambda ox: strategy_key(ox[0].strategy)))]
        stage_noise = [(1 + _noise(f"block{b}", 8), st) for b, st in enumerate(getattr(self, "st", []))
                       if not isinstance(st, int)]
        max_noise = sum(max(w for w, _ in noise) for _ in inp.classes) + sum(w * (p - 1) for w, _ in stage_noise)
        self.weight = 1 << max(1, max_noise.bit_length())
        m.minimize(self.weight * self.z + sum(w * x for w, x in noise) + sum(w * st for w, st in stage_noise))

    # -- mem/block<b>/layer<j> (pp = 1): the backward's timeline, memory.step_peak_bytes ---------
    def add_timeline_rows(self, cap_kib: int, flight: int) -> None:
        """One stage (``memory.step_peak_bytes`` with f = 1): per layer j of block b,

            forward    S − [m = 1]·Gr + A_{<b} + a_{b,≤j} + (2 + prefetch)·H_{b,j}
            backward   S − [m = 1]·Gr + A_{<b} + a_{b,≤j} + [m = 1]·(Gr_{>b} + gr_{b,>j}) + max(G, gr)_{b,j}

        (one row with ``max(G, (2 + prefetch)·H)`` when m > 1: every gradient is live from the first
        micro-batch's backward on, which the later micro-batches' rows dominate). Of a run of blocks with
        the same composition only the first and the last need rows: along the run a row changes by the
        same ``A_blk`` (``A_blk − Gr_blk``) per block, so its maximum is at an end."""
        chains = self.inp.block_chain or tuple((False,) * len(m) for m in self.inp.block_classes)
        keys = [(tuple(m), tuple(c)) for m, c in zip(self.inp.block_classes, chains)]
        factor = gather_copies(self.inp.schedule.prefetch)
        ends = {b for b in range(self.num_blocks)
                if b == 0 or b == self.num_blocks - 1 or keys[b] != keys[b - 1] or keys[b] != keys[b + 1]}
        acts = [terms[3] for terms in self.block_terms]
        grads = [terms[5] for terms in self.block_terms] if self.grads_apart else None
        base = sum(terms[2] for terms in self.block_terms) + (flight - 1) * sum(acts)
        if grads is not None:
            base -= sum(grads)
            rows = (("forward", lambda o: factor * self.h(o), False), ("backward", lambda o: max(self.g(o), self.gr(o)), True))
        else:
            rows = (("step", lambda o: max(self.g(o), factor * self.h(o)), False),)
        for b in sorted(ends):
            members, chain = keys[b]
            member_acts = self._member_activations(members, chain)
            before = base + sum(acts[:b])
            for j, c in enumerate(members):
                held = before + sum(member_acts[:j + 1])
                for name, coef, with_grads in rows:
                    row = held + self.class_expr(c, coef)
                    if with_grads:
                        row += sum(grads[b + 1:]) + sum(self.class_expr(later, self.gr) for later in members[j + 1:])
                    self.model.add(row <= cap_kib).with_name(f"mem/{name}/block{b}/layer{j}")

    def rank_buckets(self, k: int) -> cp_model.LinearExpr:
        """The optimizer step's bucket copies on rank k (``memory.optimizer_step_peak_bytes``): ``max(Y_k,
        [Σ N ≤ bucket]·Σ K)``, the layers' own or the one bucket all the rank's gradients fit. ``one[k]`` may be
        false only where Σ N exceeds the bucket (``optstep_buckets/stage<k>``)."""
        bucket_kib = self.inp.schedule.bucket_bytes // KIB
        if bucket_kib <= 0:
            return self.y_step_rank[k]
        bucketed, members = self._rank_sum(k, 7), self._rank_sum(k, 8)
        hi = sum(self._ub(terms[7]) for terms in self.block_terms) + self._ub_expr_y()
        one = self.model.new_bool_var(f"one_bucket[{k}]")
        self.model.add(members >= bucket_kib + 1).only_enforce_if(one.Not())
        total = self.model.new_int_var(0, hi, f"YB[{k}]")
        self.model.add(total >= self.y_step_rank[k]).with_name(f"optstep_buckets/stage{k}")
        self.model.add(total >= bucketed).only_enforce_if(one)
        return total

    def _ub_expr_y(self) -> int:
        return max((self.y_step(o) for opts in self.inp.options for o in opts), default=0)

    def stage_receive_buffers(self) -> list:
        """Per rank, its pipeline boundary buffers in KiB (evaluate.py: m per boundary its stages cross, each
        way, of the boundary layer's ``boundary_bytes``, and ``in_flight`` kept outputs where it sends). Interleaved: the fixed boundaries. Otherwise rank k
        receives activations if k > 0 and gradients if k < p − 1, of the blocks' last class (the largest of
        them when they differ, as ``stage_p2p``)."""
        p, blocks, mb = self.pp, self.inp.block_classes, self.inp.schedule.num_micro_batches
        if p == 1 or not blocks:
            return [0] * p
        last = [members[-1] for members in blocks]
        kept = [math.ceil(in_flight(self.inp.schedule, p, k)) for k in range(p)]  # outputs a sender keeps
        if self.block_stage_fixed is not None:
            fixed, out = self.block_stage_fixed, [0] * p
            for b in range(len(blocks) - 1):
                if fixed[b] != fixed[b + 1]:
                    sender, receiver = fixed[b] % p, fixed[b + 1] % p
                    out[sender] += self.class_expr(last[b], lambda o, k=sender: (mb + kept[k]) * _kib(o.boundary_bytes))
                    out[receiver] += self.class_expr(last[b], lambda o: mb * _kib(o.boundary_bytes))
            return out
        senders = sorted(set(last[:-1]))
        q = lambda o: _kib(o.boundary_bytes)  # noqa: E731
        if len(senders) == 1:
            expr = self.class_expr(senders[0], q)
        else:
            expr = self.model.new_int_var(0, max(q(o) for c in senders for o in self.inp.options[c]), "Q")
            for c in senders:
                self.model.add(expr >= self.class_expr(c, q)).with_name("stage_receive/max")
        return [expr * (mb * ((k > 0) + (k < p - 1)) + (k < p - 1) * kept[k]) for k in range(p)]

    def stage_p2p(self) -> list[tuple]:
        """Per rank, (send/recv expression per micro-batch, its upper bound): P of the last layer of
        each block followed by a stage boundary (``stage_p2p/stage<k>``). Interleaved: the fixed
        boundaries. Otherwise every rank but the last sends once, after its last block; when the
        blocks' last classes differ, ``P_k`` bounds all of them (exact for homogeneous blocks)."""
        p, blocks = self.pp, self.inp.block_classes
        if p == 1 or not blocks:
            return [(0, 0)] * p
        last = [members[-1] for members in blocks]

        def hi(c: int) -> int:
            return max(self.p2p(o) for o in self.inp.options[c])

        if self.block_stage_fixed is not None:
            fixed, out = self.block_stage_fixed, [[0, 0] for _ in range(p)]
            for b in range(len(blocks) - 1):
                if fixed[b] != fixed[b + 1]:
                    k = fixed[b] % p
                    out[k][0] = out[k][0] + self.class_expr(last[b], self.p2p)
                    out[k][1] += hi(last[b])
            return [tuple(o) for o in out]
        senders = sorted(set(last[:-1]))
        if len(senders) == 1:
            expr, bound = self.class_expr(senders[0], self.p2p), hi(senders[0])
        else:
            bound = max(hi(c) for c in senders)
            expr = self.model.new_int_var(0, bound, "P")
            for c in senders:
                self.model.add(expr >= self.class_expr(c, self.p2p)).with_name("stage_p2p/max")
        return [(expr, bound)] * (p - 1) + [(0, 0)]

    def add_hints(self) -> None:
        for c, strategy in enumerate(self.inp.hint):
            if strategy is None:
                continue
            want = strategy_key(strategy)
            for o, x in zip(self.inp.options[c], self.x[c]):
                self.model.add_hint(x, strategy_key(o.strategy) == want)
        if self.inp.hint_block_stage and getattr(self, "st", None) and self.v == 1:
            for st, stage in zip(self.st, self.inp.hint_block_stage):
                if not isinstance(st, int):
                    self.model.add_hint(st, stage)


def stage_windows(num_blocks: int, pp: int) -> list[tuple[int, int]]:
    """Per anchor block, the (lowest, highest) stage CP-SAT may place it on (non-interleaved).

    Boundary k (the first block of stage k) lies within ``max(2, ⌈B/p⌉)`` blocks of
    ``round(k·B/p)``; block b sits on a stage ≤ b and leaves ≥ 1 block for every later stage.
    """
    B, p = num_blocks, pp
    width = max(2, math.ceil(B / p))
    centres = [round(k * B / p) for k in range(1, p)]
    return [(max(sum(1 for c in centres if c + width <= b), p - (B - b), 0),
             min(sum(1 for c in centres if c - width <= b), b, p - 1)) for b in range(B)]


def build(inp: ModelInput, *, build_rows: bool = True) -> _Builder:
    """Build the model for ``inp`` (families in the solver docstring); without the ``build/stage<k>``
    rows (and their ``R`` terms and ``X_k``) when ``build_rows`` is False: a relaxation."""
    builder = _Builder(inp)
    builder.add_strategy_choice()
    builder.add_block_terms(build_rows)
    builder.add_stage_assignment()
    builder.add_buffer_max(build_rows)
    builder.add_stage_rows_and_objective()
    builder.add_hints()
    return builder


def _kib(nbytes: float) -> int:
    """Bytes → KiB, rounded up (the cap is rounded down: rounding never admits an over-budget plan)."""
    return int(math.ceil(nbytes / KIB))


def fits_build_rows(inp: ModelInput, result: ModelResult) -> bool:
    """Whether a decoded answer satisfies every ``build/stage<k>`` row, in the rows' KiB units."""
    p, v = inp.mesh.pp, virtual_stages(inp.schedule)
    resident, transient = [0] * p, [0] * p
    for members, stage in zip(inp.block_classes, result.block_stage):
        k = stage % p if v > 1 else stage
        for c in members:
            option = inp.options[c][result.choice[c]]
            resident[k] += _kib(option.build_resident_bytes)
            transient[k] = max(transient[k], _kib(option.build_transient_bytes))
    return all(r + x <= inp.cap_bytes // KIB for r, x in zip(resident, transient))


# Two workers run exactly these (``docs/search.md``, speed): CP-SAT's default two-worker portfolio has
# no LP-based subsolver and stalls on layer-choice models; with both LP workers every measured model
# proved optimality, with the least CPU time of 1, 2 (LP), and 8 workers.
LP_SUBSOLVERS = ("default_lp", "max_lp")


def solve_model(inp: ModelInput, *, time_limit_s: float, num_workers: int, seed: int = 0,
                build_rows: bool = True) -> ModelResult:
    """Build and solve; ``status`` is the CP-SAT status name. ``num_workers == 2`` runs ``LP_SUBSOLVERS``.
    ``build_rows=False`` solves the relaxation without the ``build/stage<k>`` rows (``build``)."""
    return _solve(build(inp, build_rows=build_rows), inp, time_limit_s, num_workers, seed)


def _solve(builder: _Builder, inp: ModelInput, time_limit_s: float, num_workers: int, seed: int) -> ModelResult:
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = max(time_limit_s, 0.01)
    params.num_workers = num_workers
    if num_workers == len(LP_SUBSOLVERS):
        params.subsolvers.extend(LP_SUBSOLVERS)
    params.random_seed = seed
    status = solver.status_name(solver.solve(builder.model))
    if status not in ("OPTIMAL", "FEASIBLE"):
        return ModelResult(status, (), (), math.inf, _bound_s(solver, builder, inp, status))
    choice = tuple(next(i for i, x in enumerate(xs) if solver.boolean_value(x)) for xs in builder.x)
    if builder.block_stage_fixed is not None:
        block_stage = tuple(builder.block_stage_fixed)
    else:
        block_stage = tuple(st if isinstance(st, int) else solver.value(st) for st in builder.st)
    return ModelResult(status, choice, block_stage, solver.value(builder.z) * inp.unit_s,
                       _bound_s(solver, builder, inp, status))


def _bound_s(solver: cp_model.CpSolver, builder: _Builder, inp: ModelInput, status: str) -> float:
    if status == "INFEASIBLE":
        return math.inf
    if status == "UNKNOWN":
        return 0.0
    return math.floor(solver.best_objective_bound / builder.weight) * inp.unit_s


def block_members(block_of_layer: Sequence[int], class_of_layer: Sequence[int], num_blocks: int) -> tuple:
    """Per anchor block, the solver-class index of each layer riding on it."""
    out: list[list[int]] = [[] for _ in range(num_blocks)]
    for b, c in zip(block_of_layer, class_of_layer):
        out[b].append(c)
    return tuple(tuple(members) for members in out)
