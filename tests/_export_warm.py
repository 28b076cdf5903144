"""Imported by the gloo jobs' forkserver (``_harness._PRELOAD``): what most multi-process tests build is
prepared once there, so every rank forked from it finds it ready instead of redoing it (~5-10 s of a
loaded core per rank and model):

- the reference models' exports (``runtime/export_cache.py``) and captured graphs (``_runtime_cases.graph_of``);
- the tiny Hugging Face policies of ``_hf_tp_cases`` (when ``transformers`` is installed): ``transformers``
  imported, their exports and captured graphs (``_hf_tp_cases.graph_of``).

Built on meta: nothing runs an op on a real device in the server (``_harness`` note "forkserver"; an
HF policy's rotary table is a few CPU ops on tiny tensors, below any intra-op parallel threshold). A
model not listed here, or built with other options, is exported and captured by the rank as before.
"""

from __future__ import annotations

import torch

from _runtime_cases import graph_of
from autoshard.models import build
from autoshard.runtime.program import prime_export_cache

WARM = (
    ("llama:tiny", {}, torch.float32),
    ("llama:tiny", {}, torch.bfloat16),
    ("gpt:tiny", {}, torch.float32),
    ("moe:tiny", {}, torch.float32),
    ("llama:tiny", {"num_layers": 4}, torch.float32),
)
GRAPHS = ("llama:tiny", "gpt:tiny", "moe:tiny")
HF = ("llama", "qwen2", "mixtral", "gpt2")  # the HF policies the gloo tests train most

for _spec, _overrides, _dtype in WARM:
    prime_export_cache(build(_spec, device="meta", **_overrides), _dtype)
for _spec in GRAPHS:
    graph_of(_spec)

try:
    import transformers  # noqa: F401
except ImportError:
    transformers = None
if transformers is not None:
    import _hf_tp_cases
    from autoshard.models.hf import actor_critic

    for _name in HF:
        prime_export_cache(actor_critic(_hf_tp_cases.config_of(_name), dtype=torch.float32))
        _hf_tp_cases.graph_of(_name)
