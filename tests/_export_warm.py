"""Imported by the gloo jobs' forkserver (``_harness._PRELOAD``): the reference models most multi-process
tests build are exported once there, so every rank forked from it finds them in its export cache
(``runtime/export_cache.py``) instead of exporting them again (~5-10 s of a loaded core per rank and model).

Built on meta: nothing runs an op in the server (``_harness`` note "forkserver"). A model not listed
here, or built with other options, is exported by the rank as before.
"""

from __future__ import annotations

import torch

from autoshard.models import build
from autoshard.runtime.program import prime_export_cache

WARM = (
    ("llama:tiny", {}, torch.float32),
    ("llama:tiny", {}, torch.bfloat16),
    ("gpt:tiny", {}, torch.float32),
    ("moe:tiny", {}, torch.float32),
    ("llama:tiny", {"num_layers": 4}, torch.float32),
)

for _spec, _overrides, _dtype in WARM:
    prime_export_cache(build(_spec, device="meta", **_overrides), _dtype)
