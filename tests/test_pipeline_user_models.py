"""Pipeline parallelism on models the project did not write equals single-device training.

Hugging Face actor-critic policies as ``autoshard.models.hf`` builds them (tiny random Llama, Qwen2,
Mixtral and GPT-2 configs, fp32): their rotary tables are recomputed on every stage (no parameter
feeds them), their decoder layers' outputs cross a boundary as tensors, Mixtral's MoE blocks run
inside a stage, and GPT-2's tied ``wte`` / ``lm_head`` is held by both pp ranks
(``passes/split_pipeline.py``, [Note: parameters shared between pp ranks]). Each trains 3 SGD steps
(2 micro-batches, clipping on; ``tests/_runtime_cases.py``) under pp=2 on 2 gloo ranks and
pp=2 × dp_shard=2 (ZeRO-1/2/3) on 4, GPT-2 also interleaved (4 virtual stages), with compiled stages
(``aot_eager``) and under pp=2 × tp=2; one gloo job per world size, the parent's captured graphs carried
to the ranks. Losses on every rank, the final
parameters (rebuilt from every rank's shards) and an inference ``forward`` match plain PyTorch at
rtol 1e-5.

User modules returning a dict, a ``transformers`` ``ModelOutput`` (with every block's hidden state:
values that skip to the last stage and get no gradient), a registered dataclass or a dict with
constant entries (``None``, a number) train the same way and get their outputs back in their own
structure, under pp and under plain data parallelism. What the pipeline cannot run (a non-tensor
output, a boundary value whose shape depends on the data) is refused while the program is built,
before any step (``fake_world``: no process started), naming the node, its layer and the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _harness import fake_world, run_gloo_cases  # noqa: E402
from _tiers import sample  # noqa: E402
from _hf_tp_cases import build_hf, graph_of as hf_graph, reassemble  # noqa: E402
from _runtime_cases import BATCH, MICRO, OPT, SEQ, batches  # noqa: E402
from _runtime_cases import single_device as reference  # noqa: E402
from _user_models import NanoPolicy  # noqa: E402
from autoshard.errors import PlanError  # noqa: E402
from autoshard.passes import capture  # noqa: E402
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule  # noqa: E402
from autoshard.runtime import BuildOptions, build_program  # noqa: E402
from autoshard.search.space import is_tp_able  # noqa: E402
from autoshard.train import TrainSpec  # noqa: E402

TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32")
PP2, PP2_DP2 = Mesh(pp=2), Mesh(pp=2, dp_shard=2)


# --------------------------------------------------------------------------- user models


@dataclasses.dataclass
class PolicyOutput:
    """A plain dataclass output, registered as a pytree node (what torch.export needs to flatten it)."""

    logits: torch.Tensor
    value: torch.Tensor


torch.utils._pytree.register_dataclass(PolicyOutput)


@dataclasses.dataclass
class HFStyleOutput(transformers.utils.ModelOutput):
    """A ``transformers`` ``ModelOutput`` (not a field called ``values``: it would hide the dict method)."""

    logits: torch.Tensor | None = None
    value: torch.Tensor | None = None
    hidden_states: tuple | None = None  # left None: a constant leaf


class DictPolicy(NanoPolicy):
    def forward(self, tokens):
        logits, values = super().forward(tokens)
        return {"logits": logits, "value": values}


class ModelOutputPolicy(NanoPolicy):
    def forward(self, tokens):
        logits, values = super().forward(tokens)
        return HFStyleOutput(logits=logits, value=values)


class DataclassPolicy(NanoPolicy):
    def forward(self, tokens):
        logits, values = super().forward(tokens)
        return PolicyOutput(logits, values)


class ConstantsPolicy(NanoPolicy):
    """Outputs with constant leaves besides the tensors, nested."""

    def forward(self, tokens):
        logits, values = super().forward(tokens)
        return {"logits": logits, "extra": (None, 0.5), "value": values}


class HiddenStatesPolicy(NanoPolicy):
    """Every block's output returned too (``output_hidden_states``): the first stage's cross the boundary to the
    last stage as outputs the loss does not use (no gradient comes back for them)."""

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        hidden = []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        x = self.ln(x)
        return HFStyleOutput(logits=self.lm_head(x), value=self.critic(x).squeeze(-1), hidden_states=tuple(hidden))


class SeqLenPolicy(NanoPolicy):
    """An output the graph computes but that is no tensor (a SymInt)."""

    def forward(self, tokens):
        logits, values = super().forward(tokens)
        return {"logits": logits, "value": values, "seq_len": tokens.shape[1]}


class _KeepTokens(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.score = torch.nn.Linear(dim, 1)

    def forward(self, x):
        return x[self.score(x).squeeze(-1) > 0]  # [kept tokens, h]: as many rows as the data says


class DataDependentPolicy(NanoPolicy):
    """A token-dropping layer on the first stage whose output (its rows depend on the data) a layer of the
    last stage reads."""

    def __init__(self) -> None:
        super().__init__()
        self.keep = _KeepTokens(64)
        self.pool = torch.nn.Linear(64, 64)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        kept = self.keep(x)
        for block in self.blocks:
            x = block(x)
        x = self.ln(x) + self.pool(kept).mean(0)
        return self.lm_head(x), self.critic(x).squeeze(-1)


USER = {"dict": DictPolicy, "model_output": ModelOutputPolicy, "dataclass": DataclassPolicy,
        "constants": ConstantsPolicy, "hidden_states": HiddenStatesPolicy, "seq_len": SeqLenPolicy,
        "data_dependent": DataDependentPolicy}


def build(name: str) -> torch.nn.Module:
    """The fp32 model on the CPU, the same in every process (seeded)."""
    if name in USER:
        torch.manual_seed(0)
        return USER[name]()
    return build_hf(name)


@functools.lru_cache(maxsize=None)
def graph_of(name: str):
    if name in USER:
        return capture(USER[name](), seq_lens=(8, 16))  # on the CPU: nonzero has no meta kernel
    return hf_graph(name)


def logits_values(out):
    """(logits, values) of any of the models' output forms."""
    if isinstance(out, Mapping):  # a dict or a ModelOutput
        return out["logits"], out["value"]
    if isinstance(out, PolicyOutput):
        return out.logits, out.value
    return out


def loss_fn(out, tokens):
    logits, values = logits_values(out)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return ce + values.pow(2).mean()


def _probe():
    return batches()[0][:2, :6]  # another shape than training, no autograd


# --------------------------------------------------------------------------- plans and cases


def stage_of(layer: str, num_stages: int, num_blocks: int = 2) -> int:
    """Blocks spread evenly over the stages; what comes before the blocks on the first, after on the last."""
    block = re.match(r"(?:model\.(?:layers|h)|blocks)\.(\d+)\.", layer)
    if block:
        return int(block.group(1)) * num_stages // num_blocks
    before = layer in ("model.embed_tokens", "model.wte", "model.wpe", "tok", "pos", "keep.score")
    return 0 if before else num_stages - 1


def make_plan(name: str, mesh: Mesh, state: str = "replicate", schedule: str = "1f1b", virtual: int = 1) -> Plan:
    """``state`` on every layer with parameters; Megatron tp where the search would put it when ``mesh.tp > 1``.
    With ``virtual`` stages per rank the layers are cut evenly in graph order (each stage gets some)."""
    graph = graph_of(name)
    count = len(graph.layers)
    layers = tuple(LayerStrategy(
        layer=layer.name, stage=stage_of(layer.name, mesh.pp) if virtual == 1 else i * mesh.pp * virtual // count,
        state=state if layer.params else "replicate", tp="megatron" if mesh.tp > 1 and is_tp_able(layer) else "none")
        for i, layer in enumerate(graph.layers))
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers,
                schedule=Schedule(name=schedule, num_micro_batches=MICRO, virtual_stages=virtual))


def train_case(rank, world_size, name: str, plan: Plan, backend: str | None = None, graph=None):
    """Build ``plan`` for ``name`` (eager, or each stage compiled with ``backend``), run an inference forward,
    train; losses, forward, shards, placements. ``graph``: the parent's capture (else captured here)."""
    del rank, world_size
    options = BuildOptions(compile=True, backend=backend) if backend else BuildOptions(compile=False)
    program = build_program(build(name), graph or graph_of(name), plan, TRAIN, optimizer=OPT, options=options)
    forward = program(_probe())
    losses = [program.step(program.local_batch(tokens), loss_fn).loss for tokens in batches()]
    out = {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
           "coords": program.ctx.coords, "forward_type": type(forward).__name__,
           "forward": tuple(t.detach() for t in logits_values(forward))}
    if isinstance(forward, Mapping):
        out["forward_keys"] = list(forward.keys())
        out["forward_constants"] = {k: v for k, v in forward.items() if not isinstance(v, torch.Tensor)}
    if program.pipeline is not None:
        out["shared"] = program.pipeline.layout.shared
        out["compiled"] = [w.run[0] is not w.stage for w in program.pipeline.stages.values()]
    return out


@functools.lru_cache(maxsize=None)
def single_device(name: str):
    """Losses, final parameters (``_runtime_cases.single_device``) and the probe's outputs of plain training;
    ``build`` is seeded, so the probe's model starts from the same weights."""
    probe = build(name)(_probe())
    losses, params = reference(name, builder=build, loss=loss_fn)
    return losses, params, probe


def check(results: list[dict], name: str, mesh: Mesh) -> None:
    ref_losses, ref_params, ref_probe = single_device(name)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert r["forward_type"] == type(ref_probe).__name__
        for got, want in zip(r["forward"], logits_values(ref_probe), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    full = reassemble(results, mesh)
    assert set(full) == set(ref_params)  # a tied parameter once, under its first name
    for fqn, value in full.items():
        torch.testing.assert_close(value, ref_params[fqn], rtol=1e-5, atol=1e-6, msg=lambda m, fqn=fqn: f"{fqn}: {m}")


# --------------------------------------------------------------------------- Hugging Face policies (gloo)

HF = ("llama", "qwen2", "mixtral", "gpt2")
# world 4: one ZeRO state per model; GPT-2's tied weight gathered (zero2), sharded (zero3) and split over tp
HF_WORLD4 = {  # case → (mesh, state, schedule)
    "llama": (PP2_DP2, "zero3", "1f1b"), "qwen2": (PP2_DP2, "zero2", "gpipe"), "mixtral": (PP2_DP2, "zero1", "1f1b"),
    "gpt2": (PP2_DP2, "zero2", "1f1b"), "gpt2_zero3": (PP2_DP2, "zero3", "gpipe"),
    "gpt2_tp2": (Mesh(pp=2, tp=2), "replicate", "1f1b"),  # the tied weight vocab-parallel: each tp rank its rows
}
# `make test` (tests/_tiers.py): Qwen2 (Llama's layer forms) with ZeRO-2 under GPipe and GPT-2 with ZeRO-2 (the
# tied weight gathered whole) run under `make test-full` only; GPT-2's tied weight sharded runs here (ZeRO-3)
HF_WORLD4 = sample(HF_WORLD4, ("llama", "mixtral", "gpt2_zero3", "gpt2_tp2"))
# world 2: every HF policy on pp 2; GPT-2 also with compiled stages and interleaved (4 virtual stages)
HF_WORLD2 = {  # case → (model, plan, stage backend)
    **{name: (name, lambda name=name: make_plan(name, PP2), None) for name in HF},
    "gpt2_compiled": ("gpt2", lambda: make_plan("gpt2", PP2), "aot_eager"),
    "gpt2_interleaved": ("gpt2", lambda: make_plan("gpt2", PP2, schedule="interleaved_1f1b", virtual=2), None),
}


def _case(name: str, plan: Plan, backend: str | None = None):
    """A job case; the parent's captured graph travels with it, so no rank captures the model."""
    return functools.partial(train_case, name=name, plan=plan, backend=backend, graph=graph_of(name))


@pytest.fixture(scope="module")
def hf_results2():
    """Every world-2 HF case in one gloo job (``_harness`` note "spawned jobs are expensive")."""
    return run_gloo_cases({case: _case(name, plan(), backend) for case, (name, plan, backend) in HF_WORLD2.items()},
                          2, timeout_s=600)


@pytest.fixture(scope="module")
def hf_results4():
    jobs = {}
    for case, (mesh, state, schedule) in HF_WORLD4.items():
        name = case.split("_")[0]
        jobs[case] = _case(name, make_plan(name, mesh, state, schedule))
    return run_gloo_cases(jobs, 4, timeout_s=600)


@pytest.mark.parametrize("name", HF)
@pytest.mark.slow
def test_hf_policy_pp2_matches_single_device(hf_results2, name):
    results = hf_results2[name]
    check(results, name, PP2)
    if name == "gpt2":  # the tied wte/lm_head: owned by the first stage's rank, mirrored on the last
        assert [(s.fqn, s.owner, s.mirrors) for s in results[0]["shared"]] == [("model.wte.weight", 0, (1,))]
        assert "model.wte.weight" in results[0]["placements"] and "model.wte.weight" not in results[1]["placements"]
    else:
        assert results[0]["shared"] == ()


@pytest.mark.slow
def test_tied_gpt2_compiled_stages_match_single_device(hf_results2):
    """Each stage a ``torch.compile`` module (``aot_eager``: the joint graph, no code generation): the mirror's
    values are copied in place before the step, its gradient read after it."""
    results = hf_results2["gpt2_compiled"]
    assert all(all(r["compiled"]) for r in results)
    check(results, "gpt2", PP2)


@pytest.mark.slow
def test_tied_gpt2_interleaved_matches_single_device(hf_results2):
    """4 virtual stages on 2 ranks: the tied weight on stage 0 (rank 0) and stage 3 (rank 1)."""
    results = hf_results2["gpt2_interleaved"]
    check(results, "gpt2", PP2)
    assert [(s.fqn, s.owner, s.mirrors) for s in results[1]["shared"]] == [("model.wte.weight", 0, (1,))]


@pytest.mark.parametrize("case", list(HF_WORLD4))
@pytest.mark.slow
def test_hf_policy_world4_matches_single_device(hf_results4, case):
    name = case.split("_")[0]
    mesh = HF_WORLD4[case][0]
    results = hf_results4[case]
    check(results, name, mesh)
    if name == "gpt2":  # ZeRO-3 too: the last stage gathers its own copy (a weight-derived node), nothing else crosses
        assert all([s.fqn for s in r["shared"]] == ["model.wte.weight"] for r in results)


# --------------------------------------------------------------------------- user output forms (gloo)

USER_CASES = {  # case → (model, mesh); pp=1 cases: the plain data-parallel program with the same outputs
    "dict": ("dict", PP2),
    "model_output": ("model_output", PP2),
    "dataclass": ("dataclass", PP2),
    "constants": ("constants", PP2),
    "hidden_states": ("hidden_states", PP2),
    "dict_dp2": ("dict", Mesh(dp_shard=2)),
    "model_output_dp2": ("model_output", Mesh(dp_replicate=2)),
}


@pytest.fixture(scope="module")
def user_results():
    jobs = {case: _case(name, make_plan(name, mesh, "zero3" if mesh.pp == 1 else "replicate"))
            for case, (name, mesh) in USER_CASES.items()}
    return run_gloo_cases(jobs, 2, timeout_s=300)


@pytest.mark.parametrize("case", list(USER_CASES))
@pytest.mark.slow
def test_user_output_forms_train_as_single_device(user_results, case):
    name, mesh = USER_CASES[case]
    results = user_results[case]
    check(results, name, mesh)
    for r in results:
        if name == "constants":  # constant leaves come back where the model put them
            assert r["forward_keys"] == ["logits", "extra", "value"]
            assert r["forward_constants"] == {"extra": (None, 0.5)}
        elif name in ("dict", "model_output"):
            assert r["forward_keys"] == ["logits", "value"]


# --------------------------------------------------------------------------- refused while building (no process)


def _build(name: str, plan: Plan, rank: int = 0):
    with fake_world(plan.mesh.world_size, rank):
        return build_program(build(name), graph_of(name), plan, TRAIN, options=BuildOptions(compile=False))


def test_non_tensor_output_is_refused():
    with pytest.raises(PlanError, match=r"model output \['seq_len'\] is a SymInt .*return it as a tensor"):
        _build("seq_len", make_plan("seq_len", PP2))


def test_data_dependent_boundary_is_refused():
    """The kept tokens' rows are known only when the step runs: the schedule could not size their buffer."""
    with pytest.raises(PlanError, match=r"index\w* \(module 'keep', between plan layers\), crossing into stage 1, "
                                        r"has shape \(u\d+, 64\), which depends on the data"):
        _build("data_dependent", make_plan("data_dependent", PP2))
