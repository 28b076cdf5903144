"""Shims for older torch versions the GPU machines run (torch ≥ 2.11), tested on the CPU build."""

from __future__ import annotations

import torch
from torch.utils import flop_counter as fc

from autoshard.runtime.program import _gqa_flop_formulas

_SDPA = (torch.ops.aten._scaled_dot_product_flash_attention, torch.ops.aten._scaled_dot_product_flash_attention_backward)


def test_gqa_flop_formulas_count_broadcast_heads_where_torch_refuses(monkeypatch):
    """torch < 2.13's SDPA flop formula asserts equal head counts (inductor then fails to compile a GQA model
    with collectives); the shim counts the key/value heads broadcast to the query's, and is a no-op on a torch
    that counts GQA itself."""
    saved = {op: fc.flop_registry[op] for op in _SDPA}
    exact = fc.sdpa_flop_count((2, 8, 16, 32), (2, 8, 16, 32), (2, 8, 16, 32))
    exact_bwd = fc.sdpa_backward_flop_count((2, 8, 16, 32), (2, 8, 16, 32), (2, 8, 16, 32), (2, 8, 16, 32))
    q, kv = torch.empty(2, 8, 16, 32, device="meta"), torch.empty(2, 2, 16, 32, device="meta")
    try:
        _gqa_flop_formulas()  # this torch counts GQA: the registry is left as it was
        assert all(fc.flop_registry[op] is saved[op] for op in _SDPA)
        strict, strict_bwd = fc.sdpa_flop_count, fc.sdpa_backward_flop_count

        def refuses(query, key, value):
            if query[1] != key[1]:
                raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
            return strict(query, key, value)

        def refuses_bwd(grad_out, query, key, value):
            if query[1] != key[1]:
                raise AssertionError("sdpa_backward_flop_count: shapes are incompatible")
            return strict_bwd(grad_out, query, key, value)

        monkeypatch.setattr(fc, "sdpa_flop_count", refuses)
        monkeypatch.setattr(fc, "sdpa_backward_flop_count", refuses_bwd)
        _gqa_flop_formulas()
        assert fc.flop_registry[_SDPA[0]](q, kv, kv, out_val=q) == exact
        assert fc.flop_registry[_SDPA[1]](q, q, kv, kv, out_val=(q, kv, kv)) == exact_bwd
    finally:
        fc.flop_registry.update(saved)
