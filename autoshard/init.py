"""Shard-friendly initialisation: a parameter's values depend only on (seed, name, element index).

A model that must be sharded is built on the meta device and each rank creates
only its own shards. For the shards to hold what a single-device build holds,
whatever the plan (DDP, ZeRO-3, TP, PP, ...), a value may not depend on which
rank draws it or in which order tensors are drawn. torch's generators are
sequential streams (the CPU's Mersenne Twister cannot skip ahead), so this
module draws from a counter-based generator instead: element ``i`` (its flat
index in the *global* tensor) of parameter ``name`` under ``seed`` is

    k0, k1  = two 32-bit words of blake2b(seed, name)
    h       = mix(mix(lo32(i) ^ k0) ^ hi32(i) ^ k1)
    u       = (h + 0.5) / 2³²                       ∈ (0, 1)
    Normal(μ, σ):  μ + σ · √2 · erfinv(2u − 1)       (inverse CDF)
    Uniform(a, b): a + (b − a) · u

``mix`` is a 32-bit integer finaliser (two xor-shift-multiply rounds,
"lowbias32"), computed with int64 tensor ops and 16-bit split multiplies so
nothing overflows. Values are computed in float64 and rounded to float32:
equal bit for bit on one device type for any region and any chunking; CPU and
CUDA may differ in the last float32 bit (their ``erfinv``).

A region is a tuple of ``slice(start, stop)``, one per tensor dim
(``ParamPlacement.region``); ``init_region`` computes only the region's
elements, in chunks of at most ``chunk_elements(device)`` (2¹⁶ on the CPU,
2²² on a GPU; ``_chunks`` cuts along a later dim where one dim-0 row is
larger), so the temporaries stay a fixed workspace (3 MiB, 192 MiB)
whatever the parameter's size.

Models opt in with ``init_rule(fqn) -> InitRule`` (the reference models do;
their ``init_weights(seed)`` is ``init_tensor_`` over every parameter, so a
single-device build and every sharded build agree). Models without it are
initialised by ``runtime/materialize.py``'s module fallback (see there).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = 1 << 16  # on the CPU: fastest on 2 cores (the temporaries stay in cache)
ACCELERATOR_CHUNK_ELEMENTS = 1 << 22  # on a GPU: few launches (a 7B model's init took 68 s at 2**16 on 2 H200s)
_WORKSPACE_PER_ELEMENT = 48  # int64 index and hash words, float64 values alive at once (~28 measured on the CPU)
# Bytes of temporaries one chunk needs at most: a fixed workspace whatever the parameter's size.
WORKSPACE_BYTES = _WORKSPACE_PER_ELEMENT * CHUNK_ELEMENTS
_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class Normal:
    """N(mean, std²)."""

    mean: float = 0.0
    std: float = 1.0


@dataclass(frozen=True)
class Uniform:
    """U(low, high)."""

    low: float = 0.0
    high: float = 1.0


@dataclass(frozen=True)
class Constant:
    """Every element ``value`` (zeros, ones)."""

    value: float = 0.0


InitRule = Normal | Uniform | Constant


def _key(seed: int, name: str) -> tuple[int, int]:
    digest = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2³² for int64 ``x`` in [0, 2³²): c split in 16-bit halves so no product passes 2⁴⁸."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _uniform(index: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """A float64 uniform in (0, 1) per global flat ``index`` (int64)."""
    h = _mix(_mix((index & _MASK) ^ key[0]) ^ (index >> 32) ^ key[1])
    return (h.double() + 0.5) * (1.0 / 2.0**32)


def _values(rule: InitRule, index: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    if isinstance(rule, Constant):
        return torch.full(index.shape, float(rule.value), dtype=torch.float64, device=index.device)
    u = _uniform(index, key)
    if isinstance(rule, Uniform):
        return rule.low + (rule.high - rule.low) * u
    return rule.mean + (rule.std * math.sqrt(2.0)) * torch.erfinv(2.0 * u - 1.0)


def chunk_elements(device: torch.device) -> int:
    """Elements ``init_region`` computes per chunk on ``device`` (its workspace is 48 bytes an element)."""
    return CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS


def full_region(shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The region covering a whole tensor of ``shape``."""
    return tuple(slice(0, n) for n in shape)


def _flat_index(global_shape: tuple[int, ...], region: tuple[slice, ...], device: torch.device) -> torch.Tensor:
    """Global row-major flat index of every element of ``region`` (int64, region-shaped)."""
    stride, index = 1, torch.zeros((), dtype=torch.int64, device=device)
    for dim in reversed(range(len(global_shape))):
        part = torch.arange(region[dim].start, region[dim].stop, dtype=torch.int64, device=device) * stride
        index = part.view(-1, *([1] * (len(global_shape) - 1 - dim))) + index
        stride *= global_shape[dim]
    return index


def init_region(rule: InitRule, seed: int, name: str, global_shape: tuple[int, ...], region: tuple[slice, ...],
                device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 values of ``rule`` at ``region`` of the global tensor ``name`` (module docstring)."""
    global_shape = tuple(int(n) for n in global_shape)
    sizes = tuple(s.stop - s.start for s in region)
    out = torch.empty(sizes, dtype=torch.float32, device=device)
    if out.numel() == 0 or isinstance(rule, Constant):
        return out.fill_(float(getattr(rule, "value", 0.0)))
    if not global_shape:  # a scalar parameter
        index = torch.zeros((), dtype=torch.int64, device=out.device)
        return out.copy_(_values(rule, index, _key(seed, name)))
    key = _key(seed, name)
    for part in _chunks(sizes, chunk_elements(out.device)):
        rows = tuple(slice(r.start + p.start, r.start + p.stop) for r, p in zip(region, part))
        out[part] = _values(rule, _flat_index(global_shape, rows, out.device), key)
    return out


def _chunks(sizes: tuple[int, ...], limit: int) -> Iterator[tuple[slice, ...]]:
    """Sub-regions (slices relative to a region of ``sizes``) of at most ``limit`` elements each, in row-major
    order: whole trailing dims while they fit, split along the first dim d whose trailing block
    ``prod(sizes[d+1:])`` fits, one index at a time on the dims before d (an expert weight ``[1, f, h]``
    is cut along ``f``; cutting along dim 0 alone would make it one chunk of ``f·h`` elements)."""
    d = 0
    while d < len(sizes) - 1 and math.prod(sizes[d + 1:]) > limit:
        d += 1
    step = max(1, limit // max(1, math.prod(sizes[d + 1:])))
    trailing = tuple(slice(0, n) for n in sizes[d + 1:])
    for outer in itertools.product(*(range(n) for n in sizes[:d])):
        for start in range(0, sizes[d], step):
            yield (*(slice(i, i + 1) for i in outer), slice(start, min(sizes[d], start + step)), *trailing)


@torch.no_grad()
def init_tensor_(tensor: torch.Tensor, rule: InitRule, seed: int, name: str) -> torch.Tensor:
    """Fill the whole ``tensor`` (any dtype, any device but meta) with ``rule``'s values for ``name``."""
    return tensor.copy_(init_region(rule, seed, name, tuple(tensor.shape), full_region(tuple(tensor.shape)),
                                    tensor.device))


__all__ = ["ACCELERATOR_CHUNK_ELEMENTS", "CHUNK_ELEMENTS", "WORKSPACE_BYTES", "chunk_elements", "Constant", "InitRule", "Normal", "Uniform", "full_region", "init_region", "init_tensor_"]
