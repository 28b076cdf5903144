# temporary diagnostic (deleted after the device run)
import json, os, sys, torch
from autoshard.kernels import QuantLayout, reference
from autoshard.kernels import triton_kernels as tk
tk._PAIRS_FP8_QUANTIZE_ON_CUDA = True
torch.manual_seed(0)
n, block = 1 << 20, 512
x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
lay = QuantLayout("fp8", block, n, 1)
ref = reference.quantize_ref(x, lay)
res = {}
for name, cfg in {"pairs": tk.KernelConfig("pairs", 8192, 8), "pairs_w4": tk.KernelConfig("pairs", 1024, 4),
                  "tile": tk.KernelConfig("tile", 8192, 8)}.items():
    got = tk.quantize_triton(x, lay, cfg)
    bad = (got != ref).nonzero()[:, 1]
    pay = bad[bad < lay.payload_bytes]
    info = {"mismatch": int(bad.numel()), "payload": int(pay.numel()), "first": []}
    s = ref[0, lay.payload_bytes:].view(torch.float32)
    for i in pay[:8].tolist():
        inv = 448.0 / (s[i // block] * 448.0)
        info["first"].append([i, float(x[i]), float(x[i].float() * (448.0 / x[(i // block) * block:(i // block + 1) * block].float().abs().max())),
                              int(ref[0, i]), int(got[0, i]), int(got[0, i ^ 1])])
    res[name] = info
print(json.dumps(res))
