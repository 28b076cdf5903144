"""``runtime/inductor_fallback.py``: a graph that inductor's overlap passes fail on compiles again without
them, from an untouched copy, forward and backward alike; any other failure is raised. On the CPU the
overlap passes never run, so a stand-in ``inner_compile`` fails the way they failed on the GPU (an
assertion raised from ``torch/_inductor/fx_passes/overlap_preserving_bucketer.py``) and compiles with
``make_boxed_func`` (no C++ toolchain needed)."""

from __future__ import annotations

import pytest
import torch
from torch._functorch.aot_autograd import make_boxed_func

from autoshard.runtime.inductor_fallback import OVERLAP_OFF, overlap_on, overlap_safe_backend, raised_in_overlap_pass

OVERLAP = "aten_distributed_optimizations.enable_overlap_scheduling"


def _raiser(path: str):
    """A function whose frame is in ``path`` and raises an AssertionError there."""
    namespace: dict = {}
    exec(compile("def boom():\n    assert False, 'bucket mismatch'\n", path, "exec"), namespace)
    return namespace["boom"]


PASS_FILE = "/site-packages/torch/_inductor/fx_passes/overlap_preserving_bucketer.py"
OTHER_FILE = "/site-packages/torch/_inductor/codegen/triton.py"


def _wrapped(path: str) -> BaseException:
    """What inductor raises: an error wrapping the pass's own, with its traceback."""
    try:
        try:
            _raiser(path)()
        except AssertionError as inner:
            raise RuntimeError("InductorError: AssertionError") from inner
    except RuntimeError as outer:
        return outer
    raise AssertionError("unreachable")


def test_failure_is_attributed_to_the_overlap_passes_by_its_frames():
    assert raised_in_overlap_pass(_wrapped(PASS_FILE))
    assert not raised_in_overlap_pass(_wrapped(OTHER_FILE))
    assert not raised_in_overlap_pass(ValueError("no traceback"))
    assert overlap_on({OVERLAP: True}) and not overlap_on({"max_autotune": True})


class _FlakyPasses:
    """``inner_compile`` stand-in: with the overlap passes on, it half rewrites the graph (erases its
    output's producer) and raises from the pass's file; with them off it compiles the graph it got."""

    def __init__(self, path: str = PASS_FILE):
        self.path, self.calls = path, []

    def __call__(self, gm, example_inputs, **kwargs):
        on = bool(torch._inductor.config.get_config_copy().get(OVERLAP))
        self.calls.append((on, kwargs.get("is_backward", False), len(list(gm.graph.nodes))))
        if on:
            gm.graph.eliminate_dead_code()
            for node in reversed(list(gm.graph.nodes)):
                if node.op == "call_function" and not node.users:
                    gm.graph.erase_node(node)
                    break
            _raiser(self.path)()
        return make_boxed_func(gm.forward)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_forward_and_backward_compile_again_without_the_passes_and_train_the_same():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    reference = model(x).square().sum()
    reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    record: list[str] = []
    stand_in = _FlakyPasses()
    compiled = torch.compile(model, backend=overlap_safe_backend({OVERLAP: True}, record, inner_compile=stand_in))
    loss = compiled(x).square().sum()
    loss.backward()
    torch._dynamo.reset()

    # fp32, the same ops through AOT autograd's decompositions: summation order differs (~1e-7 absolute)
    assert torch.allclose(loss, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # forward and backward: one failed try with the passes, one without, on graphs of the same size
    assert [(on, bw) for on, bw, _ in stand_in.calls] == [(True, False), (False, False), (True, True), (False, True)]
    assert stand_in.calls[0][2] == stand_in.calls[1][2] and stand_in.calls[2][2] == stand_in.calls[3][2]
    assert len(record) == 2 and record[0].startswith("forward: AssertionError") and record[1].startswith("backward")
    assert torch._inductor.config.get_config_copy().get(OVERLAP) is False  # the patch did not leak


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_other_failures_are_raised_and_passes_off_compiles_once():
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    stand_in = _FlakyPasses(OTHER_FILE)
    compiled = torch.compile(model, backend=overlap_safe_backend({OVERLAP: True}, [], inner_compile=stand_in))
    with pytest.raises(Exception, match="bucket mismatch"):
        compiled(torch.randn(2, 4))
    torch._dynamo.reset()

    quiet = _FlakyPasses()
    record: list[str] = []
    compiled = torch.compile(model, backend=overlap_safe_backend({k: False for k in OVERLAP_OFF}, record,
                                                                 inner_compile=quiet))
    compiled(torch.randn(2, 4)).sum().backward()
    torch._dynamo.reset()
    assert [on for on, _, _ in quiet.calls] == [False, False] and record == []
