"""Host and wall time of a plain eager forward + backward (and a no_grad forward) on one GPU, per counted kernel.

No optimizer, no data parallelism: the model's own step, against the cost model's counted kernels
(``layer_terms.forward_kernels``; backward counts twice). The calibration's eager probe (``autoshard/calibrate.py``,
``EAGER_PROBE``) is the last row. ``python benchmarks/eager_host_probe.py`` on a CUDA machine; results in
``benchmarks/results/rl_step_h200x4_2026-11-28/call5/host_probe.txt``.
"""
import time, torch, statistics, sys
from autoshard.models import build
from autoshard.passes.capture import capture_reference
from autoshard.search import layer_terms
dev = torch.device("cuda")
for spec, b in (("llama:1.3b", 8), ("llama:1.3b", 2), ("llama:tiny", 2)):
    kw = dict(max_seq_len=256) if spec != "llama:tiny" else dict(num_layers=4, hidden=256, num_heads=4, num_kv_heads=4, ffn_hidden=704, vocab_size=256, max_seq_len=64)
    S = kw["max_seq_len"]
    graph = capture_reference(spec, seq_lens=(16, 32), **kw)
    count = sum(layer_terms.forward_kernels(l) for l in graph.layers)
    model = build(spec, device=dev, dtype=torch.bfloat16, **kw)
    tok = torch.randint(0, 256, (b, S), device=dev)
    def loss():
        lg, v = model(tok)
        return lg.float().log_softmax(-1).mean() + v.float().mean()
    for mode in ("train", "infer"):
        hosts, walls = [], []
        for i in range(6):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            if mode == "train":
                model.zero_grad(set_to_none=True); loss().backward()
            else:
                with torch.no_grad(): loss()
            t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            if i >= 2: hosts.append(t1 - t0); walls.append(t2 - t0)
        h, w = statistics.median(hosts), statistics.median(walls)
        k = count * (3 if mode == "train" else 1)
        print(f"{spec} b={b} {mode}: host {h*1e3:.1f} ms wall {w*1e3:.1f} ms counted {k:.0f} host/counted {h/k*1e6:.1f} us", flush=True)
    del model
