"""The static decode step a CUDA graph captures (``runtime/rollout_graph.py``): a 0-d tensor position, the KV
cache written with ``index_copy_`` and read whole under a causal mask, must give the logits of the ordinary
decode step (int position, cache prefix) — on CPU here; the captured graph's replay on a GPU (``gpu`` tier)."""

from __future__ import annotations

import pytest
import torch

from autoshard.models import build


@pytest.mark.parametrize("spec", ["llama:tiny", "gpt:tiny"])
def test_tensor_position_decode_equals_the_prefix_decode(spec):
    torch.manual_seed(0)
    model = build(spec, seed=0, vocab_size=16, max_seq_len=32).eval()
    prompts = torch.randint(0, 16, (3, 7))
    steps = torch.randint(0, 16, (3, 6))
    with torch.no_grad():
        ours, theirs = model.new_cache(3, 20), model.new_cache(3, 20)
        for cache in (ours, theirs):
            model(prompts, cache=cache, start_pos=0)
        ours.keys[0][:, :, 15:] = 1e4  # garbage beyond what was written: must stay masked
        for t in range(steps.shape[1]):
            token, pos = steps[:, t:t + 1], prompts.shape[1] + t
            expected, _ = model(token, cache=theirs, start_pos=pos)
            got, _ = model(token, cache=ours, start_pos=torch.tensor(pos))
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_decode_graph_replays_the_eager_step():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from autoshard.runtime.rollout_graph import DecodeGraph

    model = build("llama:tiny", seed=0, vocab_size=16, max_seq_len=32, device="cuda").eval()
    prompts = torch.randint(0, 16, (4, 5), device="cuda")
    with torch.no_grad():
        graphed, eager = model.new_cache(4, 16), model.new_cache(4, 16)
        for cache in (graphed, eager):
            model(prompts, cache=cache, start_pos=0)
        graph = DecodeGraph(model, graphed, 4, "cuda")
        for t in range(8):
            token = torch.randint(0, 16, (4, 1), device="cuda")
            expected, _ = model(token, cache=eager, start_pos=5 + t)
            got, _ = graph.run(token, 5 + t)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_compiled_decode_step_equals_the_eager_step_and_falls_back():
    """``decode_step`` compiled (aot_eager here: the same dynamo trace as inductor, no code generation) gives the
    eager step's logits and cache writes; a backend that fails leaves the eager step (``warmed_step``)."""
    from autoshard.runtime.rollout_graph import decode_step, warmed_step

    torch._dynamo.reset()
    model = build("llama:tiny", seed=0, vocab_size=16, max_seq_len=32).eval()
    prompts = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled_cache, eager_cache = model.new_cache(3, 16), model.new_cache(3, 16)
        for cache in (compiled_cache, eager_cache):
            model(prompts, cache=cache, start_pos=0)
        compiled, eager = decode_step(model, compiled_cache, "aot_eager"), decode_step(model, eager_cache, None)
        for t in range(4):
            token, pos = torch.full((3, 1), t + 1), torch.tensor(5 + t)
            torch.testing.assert_close(compiled(token, pos)[0], eager(token, pos)[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled_cache.keys[1], eager_cache.keys[1], rtol=1e-5, atol=1e-6)

        def broken(gm, example_inputs):
            raise RuntimeError("no compiler here")

        step = warmed_step(model, eager_cache, torch.zeros(3, 1, dtype=torch.long), torch.tensor(15), broken)
        assert not hasattr(step, "_torchdynamo_orig_callable")  # the eager step came back
    torch._dynamo.reset()
