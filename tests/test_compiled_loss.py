"""The loss function compiled with the program (runtime/compiled_loss.py) and its declared price."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from autoshard.runtime.compiled_loss import CACHE_SIZE, LossCompiler, compiles_loss
from autoshard.search import layer_terms

HAS_CXX = shutil.which("g++") is not None  # inductor on the CPU


def _policy_loss(outputs, tokens):
    logits, values = outputs
    vocab = logits.shape[-1]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
    return ce + values.float().pow(2).mean()


def test_compiles_exactly_when_the_cost_model_prices_the_compiled_form():
    assert compiles_loss(True, "cuda", "inductor")
    assert not compiles_loss(True, "cpu", "inductor")  # CPU ranks: never (runs_compiled is False there too)
    assert not compiles_loss(True, "cuda", "aot_eager")
    assert not compiles_loss(False, "cuda", "inductor")
    assert layer_terms.loss_form(False) is layer_terms.EAGER_LOSS
    assert layer_terms.loss_form(True) is layer_terms.COMPILED_LOSS
    compiled, eager = layer_terms.COMPILED_LOSS, layer_terms.EAGER_LOSS
    assert compiled.peak_bytes < eager.peak_bytes and compiled.fwd_bytes + compiled.bwd_bytes < eager.fwd_bytes + eager.bwd_bytes


def test_disabled_compiler_returns_the_function_itself():
    assert LossCompiler(False)(_policy_loss) is _policy_loss


@pytest.mark.skipif(not HAS_CXX, reason="inductor needs a C++ compiler on the CPU")
@pytest.mark.slow
def test_compiled_loss_equals_eager_and_saves_what_the_declaration_says():
    """Values and gradients equal the eager loss's. What each form saves for backward (seen through
    saved-tensor hooks, which AOTAutograd's save_for_backward calls), plus the logits' gradient the
    backward writes, is the declared peak: eager saves fp32 log-probabilities (then holds their
    gradient and the logits' fp32 gradient too: 12), the compiled loss only the bf16 logits (2 + 2)."""
    b, s, v = 2, 16, 3000
    torch.manual_seed(0)
    base = torch.randn(b, s, v, dtype=torch.bfloat16)
    values = torch.randn(b, s, dtype=torch.bfloat16)
    tokens = torch.randint(0, v, (b, s))
    compiled = LossCompiler(True)(_policy_loss)

    def run(fn):
        logits = base.clone().requires_grad_()
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn((logits, values), tokens)
        loss.backward()
        big = sum(n for n in saved.values() if n > 0.01 * b * s * v)  # per-row statistics are not per logit
        return loss.detach(), logits.grad, big / (b * s * v)

    want, want_grad, eager_saved = run(_policy_loss)
    import torch._inductor.config as inductor_config

    with inductor_config.patch(force_disable_caches=True):  # compiles here, not read from a warm on-disk cache
        run(compiled)
    got, got_grad, compiled_saved = run(compiled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-5)
    assert eager_saved == pytest.approx(4.0 * (s - 1) / s)  # fp32 log-probabilities of the shifted logits
    grad_bytes = base.element_size()
    assert compiled_saved + grad_bytes == pytest.approx(layer_terms.COMPILED_LOSS.peak_bytes)


def test_a_loss_that_fails_to_compile_runs_eagerly_with_one_warning(monkeypatch, caplog):
    calls = []

    def broken_compile(fn, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("backend exploded\nsecond line")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)

    def loss_fn(x):
        calls.append(1)
        return x.sum()

    wrapped = LossCompiler(True)(loss_fn)
    with caplog.at_level(logging.WARNING, logger="autoshard.runtime.compiled_loss"):
        assert float(wrapped(torch.ones(3))) == 3.0
        assert float(wrapped(torch.ones(2))) == 2.0
    warnings = [r for r in caplog.records if "did not compile" in r.getMessage()]
    assert len(warnings) == 1 and "backend exploded" in warnings[0].getMessage()
    assert "second line" not in warnings[0].getMessage() and len(calls) == 2


def test_cache_keeps_the_last_few_loss_functions(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    compiler = LossCompiler(True)
    functions = [lambda x, i=i: x * i for i in range(CACHE_SIZE + 2)]
    wrapped = [compiler(f) for f in functions]
    assert compiler(functions[-1]) is wrapped[-1]
    assert compiler(functions[0]) is not wrapped[0]  # evicted, wrapped anew
    assert len(compiler._cache) == CACHE_SIZE
