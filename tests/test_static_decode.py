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
