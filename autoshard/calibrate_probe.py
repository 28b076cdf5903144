"""Model probe of ``autoshard cluster calibrate --model``: time the model's own layers and the optimizer.

Layer times (``probe_layers``): the reference model ``spec`` is built with one
block on the device in the compute dtype (eager, the code of
``autoshard/models`` the runtime executes) and captured on ``meta`` to name its
layers. For each structurally distinct layer (``search/measured.py``
``layer_signature``: embedding, norm, attention, MLP/MoE, head, value head)
and each micro-batch ``b`` of ``micro_batches``, at sequence length ``seq_len``
(``T = b·s`` tokens), it times

- ``fwd_s``: the forward with autograd recording, as in training;
- ``bwd_s``: forward + backward minus ``fwd_s``, the backward seeded with a
  random output gradient (parameter gradients reset to ``None`` first, as
  for the first micro-batch of a step);

each the median over ``iters`` runs of ``reps`` back-to-back calls with one
device synchronisation, divided by ``reps`` (the steady state of eager
execution: the CPU's dispatch overlaps the device's kernels as in a step).
Blocks add their residual (``x + attn(norm(x))`` is timed as ``x + attn(y)``).
The head is timed with the loss the cost model assumes, cross-entropy on
``logits.float()`` (fp32 log-softmax over all ``V``); the value head with
``values.float().pow(2).mean()``.

Compiled (``compile``, ``calibrate --compile``; ``compiled_scales``): the runtime compiles the
per-rank graph whole on CUDA (``build_program``, ``runtime/compile_regions.py``), so a layer's
compiled time is not the time of that layer compiled alone. The first version compiled each
layer's closure separately; on an H100 every such layer paid dynamo's and AOT-autograd's
per-call cost (GPT's LayerNorm backward 0.72 ms compiled alone against 0.18 ms eager) and the
layer sums over-priced the compiled step by +4% to +89%
(``benchmarks/results/calibration_h100x1_2026-11-26_compiled/``). Now the eager per-layer
samples are kept and scaled: the reference model with 1 and 3 blocks is exported, cut into the
runtime's compile regions (``"stem"``) and compiled whole; its training step (forward with the
benchmark loss, then backward) is timed per micro-batch size, and

    block = (t(3) − t(1)) / 2        rest = t(1) − block          (forward and backward apart)

are the compiled time of one block and of everything else (embedding, final norm, head, loss,
value head). Each block layer's eager sample is multiplied by ``block / Σ eager block layers``,
each other layer's by ``rest / Σ eager other layers``, so the samples add up to the compiled
model's own times while keeping the eager split between layers. A signature shared by block and
non-block layers (the final norm is a block norm's twin) takes the block factor. TP shards take
the factors of the unsharded model (the whole-model runs are unsharded). The factors are kept in
the file's ``layer_times.compiled_scales``; ``layer_times`` says ``"compiled": true``.

TP shards (``tp`` degrees > 1, when heads, kv heads, FFN width and vocabulary
divide): the layer rebuilt as one Megatron rank sees it, column linears
(q, k, v, up, gate, head) with ``out/t`` outputs and row linears (o, down)
with ``in/t`` inputs; the head then concatenates ``t`` copies of its local
logits before the loss, standing in for the all-gather the runtime inserts
(the loss runs on all ``V`` on every rank). Collectives are not timed here:
they keep their α-β model.

Compiled activations (``compiled_saved_scale``): the runtime compiles the per-rank graph on
CUDA, and inductor's min-cut partitioner saves fewer tensors for backward than eager autograd
(it recomputes cheap elementwise chains: Llama's fp32 RMSNorm and RoPE). On ``meta`` tensors,
one training step of the reference model with 1 and 2 blocks goes through ``aot_autograd``
with the default partitioner (eager-like) and with the min-cut one, under
``GpuKernelProfile``; the bytes of the forward graph's saved non-input outputs (a storage
counted once) give each partitioner's per-block bytes, and their ratio (min-cut / default) is
the scale the cost model applies to transformer-block activations of a compiled plan
(``search/cost_model.predict``). It does not see the loss's transient peak (the loss runs
outside the compiled program) or inductor's buffer reuse.

Optimizer (``probe_adamw``): ``runtime/optimizer.py``'s AdamW step itself —
bf16 gradients cast to fp32, multi-tensor clipping norms, the clip scale,
``apply_update`` (the fused AdamW kernel) and the multi-tensor write-back to the bf16 parameters —
over one large flat fp32 buffer (``s_per_param`` = slope) and over many tiny
tensors (``s_per_tensor`` = the per-tensor floor, which the multi-tensor
kernels make small).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.errors import AutoshardError

_PROBED_KINDS = ("embedding", "norm", "attention", "mlp", "moe", "head", "value_head")
_TP_KINDS = ("attention", "mlp", "head")  # what the probe shards (MoE experts are EP's, not TP's)
_COLUMN_ROLES = ("column", "vocab")


@dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """What the model probe measures (module docstring)."""

    model: str  # reference model spec, e.g. "llama:350m"
    seq_len: int
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    tp: tuple[int, ...] = (1, 2)
    reps: int = 2
    iters: int = 5
    attn_impl: str | None = None  # the model's attention path ("sdpa", "math"); None: the family default
    compile: bool = False  # scale the eager layer times to the whole-model compiled step (module docstring)

    def __post_init__(self) -> None:
        if self.seq_len < 2 or not self.micro_batches or min(self.micro_batches) < 1 or min(self.tp, default=0) < 1:
            raise AutoshardError(f"probe seq_len={self.seq_len}, micro_batches={self.micro_batches}, tp={self.tp}: "
                                 "need seq_len ≥ 2 and positive micro-batch sizes and tp degrees")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, reps: int, iters: int) -> float:
    """Seconds per call: median over ``iters`` of ``reps`` calls between two synchronisations, after a warm-up."""
    fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / reps)
    return statistics.median(samples)


# --------------------------------------------------------------------------- layers


def _role(name: str) -> str:
    """Megatron TP role of a reference-model parameter (``tp_role``; tied heads included)."""
    from autoshard.models.transformer import tp_role

    try:
        return tp_role(name)
    except AssertionError:
        return "replicate"


def _shard_linears(module: nn.Module, prefix: str, tp: int) -> nn.Module:
    """A copy of ``module`` with every column/vocab linear split by output and every row linear by input."""
    out = copy.deepcopy(module)
    targets = [out] if isinstance(out, nn.Linear) else []
    names = [""] if targets else []
    for name, child in out.named_modules():
        if isinstance(child, nn.Linear) and child is not out:
            targets.append(child)
            names.append(name)
    for name, linear in zip(names, targets):
        role = _role(f"{prefix}{'.' + name if name else ''}.weight")
        if role in _COLUMN_ROLES:
            linear.weight = nn.Parameter(linear.weight.detach()[: linear.out_features // tp].clone())
            if linear.bias is not None:
                linear.bias = nn.Parameter(linear.bias.detach()[: linear.out_features // tp].clone())
            linear.out_features //= tp
        elif role == "row":
            linear.weight = nn.Parameter(linear.weight.detach()[:, : linear.in_features // tp].clone())
            linear.in_features //= tp
    return out


def _tp_divides(layer: Any, tp: int) -> bool:
    sizes = [layer.num_heads, layer.num_kv_heads, layer.ffn_hidden, layer.vocab]
    return all(n is None or n % tp == 0 for n in sizes)


@dataclass
class _LayerRun:
    """One probed layer: a forward closure returning the output to differentiate, and its seed gradient."""

    forward: Callable[[], torch.Tensor]
    params: list[nn.Parameter]

    def step(self) -> None:
        for p in self.params:
            p.grad = None
        out = self.forward()
        out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))


def _layer_run(model: nn.Module, layer: Any, module: nn.Module, tp: int, batch: int, seq_len: int,
               dtype: torch.dtype, device: torch.device) -> _LayerRun:
    """Closure calling ``module`` as the model does for ``layer.kind`` on ``batch`` sequences."""
    cfg = model.config
    hidden = cfg.hidden
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    x = torch.randn(batch, seq_len, hidden, device=device, dtype=dtype, requires_grad=True)
    params = list(module.parameters())
    kind = layer.kind
    if kind == "embedding":
        params = list(model.parameters())
        return _LayerRun(lambda: model._embed(tokens, 0)[0], params)
    if kind == "attention":
        with torch.no_grad():
            rope = model._embed(tokens[:1], 0)[1]
        return _LayerRun(lambda: x + module(x, rope, None, 0), params)
    if kind in ("mlp", "moe"):
        return _LayerRun(lambda: x + module(x), params)
    if kind == "head":
        targets = tokens.reshape(-1)

        def head_loss() -> torch.Tensor:
            logits = module(x)  # [B, S, V/t]
            if tp > 1:  # the runtime's all-gather of vocab-parallel logits
                logits = torch.cat([logits] * tp, dim=-1)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets)

        return _LayerRun(head_loss, params)
    if kind == "value_head":
        return _LayerRun(lambda: module(x).squeeze(-1).float().pow(2).mean(), params)
    return _LayerRun(lambda: module(x), params)  # norm


def _overrides(spec: ProbeSpec, blocks: int) -> dict[str, Any]:
    """``build`` / ``capture_reference`` keywords of the probed model with ``blocks`` blocks."""
    return {"num_layers": blocks, **({"attn_impl": spec.attn_impl} if spec.attn_impl is not None else {})}


def _one_block_graph(spec: ProbeSpec, dtype: torch.dtype) -> Any:
    """The one-block model captured on ``meta``: what names the probed layers."""
    from autoshard.passes.capture import capture_reference

    return capture_reference(spec.model, seq_lens=(max(2, spec.seq_len // 2), spec.seq_len), dtype=dtype,
                             **_overrides(spec, 1))


def probe_layers(spec: ProbeSpec, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Samples ``{"signature", "layer", "tp", "tokens", "fwd_s", "bwd_s"}`` (module docstring)."""
    from autoshard.models import build
    from autoshard.search.measured import layer_signature

    meta_graph = _one_block_graph(spec, dtype)
    model = build(spec.model, device=device, dtype=dtype, **_overrides(spec, 1))
    if model.config.max_seq_len < spec.seq_len:
        raise AutoshardError(f"probe seq_len={spec.seq_len} exceeds {spec.model}'s max_seq_len="
                             f"{model.config.max_seq_len}; probe a sequence length the model supports")
    model.train()
    samples, seen = [], set()
    for layer in meta_graph:
        signature = layer_signature(layer)
        if layer.kind not in _PROBED_KINDS or signature in seen:
            continue
        seen.add(signature)
        module = model if layer.kind == "embedding" else model.get_submodule(layer.name)
        for tp in spec.tp:
            if tp > 1 and (layer.kind not in _TP_KINDS or not _tp_divides(layer, tp)):
                continue
            local = _shard_linears(module, layer.name, tp) if tp > 1 else module
            for batch in spec.micro_batches:
                run = _layer_run(model, layer, local, tp, batch, spec.seq_len, dtype, device)
                fwd = time_call(run.forward, device, spec.reps, spec.iters)
                both = time_call(run.step, device, spec.reps, spec.iters)
                samples.append({"signature": signature, "layer": layer.name, "tp": tp,
                                "tokens": batch * spec.seq_len, "fwd_s": fwd, "bwd_s": max(both - fwd, 0.0)})
                del run
    return samples


# --------------------------------------------------------------------------- compiled layer times

SCALE_BLOCKS = (1, 3)  # block counts of the whole-model compiled runs (module docstring)


def compiled_model_times(spec: ProbeSpec, device: torch.device, dtype: torch.dtype, blocks: int,
                         batch: int) -> tuple[float, float]:
    """(forward s, backward s) of one training step of ``spec.model`` with ``blocks`` blocks, exported,
    cut into the runtime's compile regions and compiled whole (module docstring)."""
    from autoshard.models import build
    from autoshard.runtime.compile_regions import insert_region_breaks

    model = build(spec.model, device=device, dtype=dtype, **_overrides(spec, blocks))
    model.train()
    tokens = torch.randint(0, model.config.vocab_size, (batch, spec.seq_len), device=device)
    gm = torch.export.export(model, (tokens,)).module()
    insert_region_breaks(gm, "stem")
    torch._dynamo.reset()
    compiled = torch.compile(gm, dynamic=False)
    params = [p for p in gm.parameters() if p.requires_grad]

    def forward() -> torch.Tensor:  # the benchmarks' policy loss (benchmarks/baselines/common.py)
        logits, values = compiled(tokens)
        vocab = logits.shape[-1]
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
        return ce + values.float().pow(2).mean()

    def step() -> None:
        for p in params:
            p.grad = None
        forward().backward()

    step()  # compile forward and backward outside the timed calls
    fwd = time_call(forward, device, spec.reps, spec.iters)
    both = time_call(step, device, spec.reps, spec.iters)
    torch._dynamo.reset()
    return fwd, max(both - fwd, 0.0)


def compile_scaled(spec: ProbeSpec, device: torch.device, dtype: torch.dtype,
                   samples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """Eager ``samples`` scaled to the compiled model's block and rest times (module docstring);
    also the factors per micro-batch: ``[{"tokens", "block_fwd", "block_bwd", "rest_fwd", "rest_bwd"}]``."""
    from autoshard.search.measured import layer_signature

    graph = _one_block_graph(spec, dtype)
    in_block: dict[str, int] = {}
    rest: dict[str, int] = {}
    for layer in graph:
        if layer.kind in _PROBED_KINDS:
            counts = in_block if layer.block is not None else rest
            signature = layer_signature(layer)
            counts[signature] = counts.get(signature, 0) + 1
    scales, out = [], [dict(s) for s in samples]
    for batch in spec.micro_batches:
        tokens = batch * spec.seq_len
        eager = {s["signature"]: s for s in samples if s["tp"] == 1 and s["tokens"] == tokens}
        one, three = (compiled_model_times(spec, device, dtype, n, batch) for n in SCALE_BLOCKS)
        span = SCALE_BLOCKS[1] - SCALE_BLOCKS[0]
        factors = {"tokens": tokens}
        for i, phase in enumerate(("fwd", "bwd")):
            block = (three[i] - one[i]) / span
            other = one[i] - SCALE_BLOCKS[0] * block
            eager_block = sum(n * eager[sig][f"{phase}_s"] for sig, n in in_block.items() if sig in eager)
            eager_rest = sum(n * eager[sig][f"{phase}_s"] for sig, n in rest.items() if sig in eager)
            if block <= 0 or other <= 0 or eager_block <= 0 or eager_rest <= 0:
                raise AutoshardError(
                    f"compiled probe of {spec.model} at micro-batch {batch}: {phase} block {block:.3g} s, rest "
                    f"{other:.3g} s from {SCALE_BLOCKS[0]} and {SCALE_BLOCKS[1]} blocks (eager {eager_block:.3g}, "
                    f"{eager_rest:.3g} s); timings too noisy to split: raise --iters")
            factors[f"block_{phase}"] = block / eager_block
            factors[f"rest_{phase}"] = other / eager_rest
        scales.append(factors)
        for sample in out:
            if sample["tokens"] != tokens:
                continue
            where = "block" if sample["signature"] in in_block else "rest"
            for phase in ("fwd", "bwd"):
                sample[f"{phase}_s"] *= factors[f"{where}_{phase}"]
    return out, scales


# --------------------------------------------------------------------------- compiled activations

_VIEW_OPS = ("view", "_unsafe_view", "t", "transpose", "detach", "permute", "reshape", "expand", "alias")


def saved_bytes(spec: str, num_layers: int, seq_len: int, micro_batch: int, partition: Callable,
                attn_impl: str | None = None) -> int:
    """Bytes the forward graph of one training step saves for backward under ``partition`` (module docstring)."""
    from torch._dynamo.backends.common import aot_autograd

    from autoshard.models import build
    from autoshard.passes._capture_saved import GpuKernelProfile

    torch._dynamo.reset()
    model = build(spec, device="meta", dtype=torch.bfloat16, num_layers=num_layers,
                  **({"attn_impl": attn_impl} if attn_impl else {}))
    total: list[int] = []

    def base(node: Any) -> Any:  # the node whose storage a view reads
        while node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _VIEW_OPS:
            node = node.args[0]
        return node

    def forward_compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Callable:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        seen = set()
        for node in output.args[0][1:]:  # the first output is the loss itself
            value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            root = base(node) if isinstance(value, torch.Tensor) else None
            if root is None or root.op == "placeholder" or root in seen:
                continue
            seen.add(root)
            total.append(value.numel() * value.element_size())
        return gm.forward

    from torch._inductor.decomposition import select_decomp_table

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _inputs: gm.forward,
                           partition_fn=partition, decompositions=select_decomp_table())  # as inductor traces
    tokens = torch.randint(0, 100, (micro_batch, seq_len), device="meta")

    def step(t: torch.Tensor) -> torch.Tensor:
        logits, values = model(t)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), t[:, 1:].reshape(-1))
        return loss + values.float().pow(2).mean()

    with GpuKernelProfile():
        torch.compile(step, backend=backend)(tokens)
    torch._dynamo.reset()
    return sum(total)


def block_saved_bytes(spec: str, seq_len: int, micro_batch: int, attn_impl: str | None = None) -> dict[str, int]:
    """Per-block saved bytes, ``{"default": …, "min_cut": …}`` (the 2-block minus the 1-block step)."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    out = {}
    for name, partition in (("default", default_partition), ("min_cut", min_cut_rematerialization_partition)):
        one, two = (saved_bytes(spec, n, seq_len, micro_batch, partition, attn_impl) for n in (1, 2))
        out[name] = two - one
    return out


def compiled_saved_scale(spec: str, seq_len: int, micro_batch: int = 1, attn_impl: str | None = None) -> float:
    """Min-cut over default per-block saved bytes: the compiled runtime's block-activation scale."""
    return saved_scale(block_saved_bytes(spec, seq_len, micro_batch, attn_impl), spec)


def saved_scale(sizes: dict[str, int], spec: str) -> float:
    """``block_saved_bytes``' min-cut over default, at most 1."""
    if sizes["default"] <= 0:
        raise AutoshardError(f"{spec}: a block saved no activations under the default partitioner; "
                             "cannot scale compiled activations")
    return min(sizes["min_cut"] / sizes["default"], 1.0)


# --------------------------------------------------------------------------- optimizer


def _adamw_step(group: list[tuple[torch.Tensor, ...]], step: int) -> float:
    """``ShardedOptimizer.step`` (runtime/optimizer.py) over one device's slots, collectives left out.

    Per slot the fp32 cast of the bf16 gradient (``set_grad``); then, as the
    optimizer does for all slots of a device at once: the clipping norms
    (``_foreach_norm``, summed on the device, one host read), the clip scale,
    the AdamW update (``apply_update``) and the write-back to the bf16
    parameters (``_foreach_copy_``).
    """
    from autoshard.runtime.optimizer import OptimizerConfig, apply_update

    masters, exp_avg, exp_avg_sq, grads16, params16 = (list(t) for t in zip(*group))
    grads = [g.to(torch.float32) for g in grads16]
    total = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
    torch._foreach_mul_(grads, 0.5)
    apply_update(OptimizerConfig(), step, masters, grads, exp_avg, exp_avg_sq)
    torch._foreach_copy_(params16, masters)
    return float(total.sqrt())  # the clip scale reaches the host once per step


def probe_adamw(device: torch.device, dtype: torch.dtype, *, big_params: int, small_tensors: int,
                iters: int) -> tuple[float, float]:
    """(seconds per parameter, seconds per tensor) of the AdamW step (module docstring)."""

    def slots(n: int, count: int) -> list[tuple[torch.Tensor, ...]]:
        return [(torch.randn(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device),
                 torch.randn(n, device=device).to(dtype), torch.empty(n, device=device, dtype=dtype))
                for _ in range(count)]

    def run(group: list[tuple[torch.Tensor, ...]]) -> Callable[[], None]:
        return lambda: _adamw_step(group, step=1)

    small = slots(1024, small_tensors)
    per_tensor = time_call(run(small), device, 1, iters) / small_tensors
    big = slots(big_params, 1)
    per_param = max(time_call(run(big), device, 1, iters) - per_tensor, 0.0) / big_params
    return per_param, per_tensor


def parse_int_list(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` → (1, 2, 4) (CLI helper); raises ``AutoshardError`` naming the text."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise AutoshardError(f"{text!r}: expected positive integers separated by commas, e.g. 1,2,4,8")
    return values


__all__ = ["ProbeSpec", "compile_scaled", "compiled_model_times", "parse_int_list", "probe_adamw", "probe_layers",
           "time_call"]
