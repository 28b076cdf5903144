#!/usr/bin/env python3
"""Build a wheelhouse for an air-gapped GPU machine.

GPU clusters often have no network. This script downloads, on a machine that
has one, the wheels autoshard needs beyond what a typical CUDA image already
holds (torch, triton, numpy), for a target Python version and Linux platform,
plus autoshard's own wheel. Carry the folder over and install with::

    python3 -m pip install --no-index --no-deps --target /tmp/site WHEELHOUSE/*.whl
    export PYTHONPATH=/tmp/site

Dependencies are resolved here, recursively, from each wheel's
``Requires-Dist`` metadata (extras and markers for other platforms skipped),
because ``pip download`` with deps would also fetch torch and the CUDA stack.
Packages the target already has are named with ``--skip`` (defaults below: a CUDA image's, plus
what this project's GPU machine also has; ``--bare-image`` keeps only the former).

``--hf`` also carries the Hugging Face stack that ``benchmarks/hf_zoo.py`` (the ``hf-*``
models of ``benchmarks/run.py``, ``materialize_bench.py``) and safetensors weights need:
transformers and safetensors at the versions measured, with whatever of their dependencies
the target lacks (the project's GPU image has them all: not needed there; about 24 MiB, of the
device tool's 64 MiB carry limit).

Usage: scripts/build_wheelhouse.py --python-version 3.12 --out .whl [--baselines] [--hf]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

CORE = ["ortools", "rich", "pyyaml", "networkx"]
# Pinned to the versions measured in docs (PLATFORM_NOTES): newer ones may change APIs.
BASELINES = ["megatron-core==0.16.1", "deepspeed==0.19.8"]
# The Hugging Face policy of the benchmarks (--hf), at the versions of the 2026-11-26 GPU runs.
HF = ["transformers==5.17.0", "safetensors==0.8.0"]
# What --hf stops skipping: the stack itself (its other needs are on the CUDA image or not skipped).
HF_STACK = {"transformers", "safetensors", "huggingface-hub", "tokenizers", "regex"}
# Present on the CUDA images this project runs on; never downloaded.
CUDA_IMAGE = {
    "torch", "triton", "numpy", "setuptools", "pip", "wheel", "typing-extensions", "filelock",
    "jinja2", "markupsafe", "sympy", "mpmath", "fsspec", "packaging", "psutil", "pynvml",
    "nvidia-ml-py", "torchvision", "pillow",
}
# Also in this project's GPU image ("cuda": torch 2.11, Python 3.12; its package list as read on
# 2026-11-17): the Hugging Face stack (transformers 5.17, safetensors 0.8: benchmarks/hf_zoo.py and
# safetensors weights), three of CORE, and pandas with its needs (OR-Tools imports pandas). What it
# lacks is OR-Tools itself and immutabledict; protobuf and absl-py are carried anyway (small, and
# OR-Tools' generated code needs protobuf >= the version it was built with).
# --bare-image downloads all of these, for an image that has only CUDA_IMAGE.
PROJECT_GPU_IMAGE = {
    "rich", "pyyaml", "networkx", "accelerate", "transformers", "safetensors", "huggingface-hub",
    "tokenizers", "regex", "pandas", "python-dateutil", "tzdata", "six",
}
DEFAULT_SKIP = CUDA_IMAGE | PROJECT_GPU_IMAGE
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _download(req: str, out: Path, py: str) -> Path | None:
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", py, "--implementation", "cp", "-d", str(out)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    cmd += ["--platform", "any", req]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        # Some packages (deepspeed) publish only an sdist: build a wheel here.
        # DS_BUILD_OPS=0 keeps it pure Python; its ops JIT-build on the target.
        build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), req]
        res = subprocess.run(build, capture_output=True, text=True, env={**os.environ, "DS_BUILD_OPS": "0"})
        if res.returncode != 0:
            print(f"  ! {req}: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else 'failed'}")
            return None
    new = set(out.glob("*.whl")) - before
    return next(iter(new), None)


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        if ";" in spec:
            spec, marker = spec.split(";", 1)
            if "extra" in marker or "win32" in marker or "darwin" in marker:
                continue
        reqs.append(spec.strip())
    return reqs


def build(out: Path, py: str, roots: list[str], skip: set[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    queue = list(roots)
    wheels = []
    while queue:
        req = queue.pop(0)
        name = _norm(re.split(r"[<>=!~\[ (]", req, maxsplit=1)[0])
        if name in seen or name in skip:
            continue
        seen.add(name)
        print(f"- {req}")
        wheel = _download(req.replace(" ", ""), out, py)
        if wheel is None:
            continue
        wheels.append(wheel)
        queue.extend(_requirements(wheel))
    return wheels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--out", default=".whl", type=Path)
    p.add_argument("--baselines", action="store_true", help="also megatron-core and deepspeed")
    p.add_argument("--hf", action="store_true",
                   help="also transformers and safetensors (HF) and their needs, for a target without them")
    p.add_argument("--skip", nargs="*", default=[], help="more packages the target already has")
    p.add_argument("--bare-image", action="store_true",
                   help="the target has only the CUDA image's packages: also download rich, pyyaml, networkx, "
                        "pandas (PROJECT_GPU_IMAGE)")
    p.add_argument("--no-self", action="store_true", help="do not build autoshard's own wheel")
    args = p.parse_args(argv)
    roots = CORE + (BASELINES if args.baselines else []) + (HF if args.hf else [])
    skip = CUDA_IMAGE if args.bare_image else DEFAULT_SKIP
    skip = (skip - HF_STACK if args.hf else skip) | {_norm(s) for s in args.skip}
    build(args.out, args.python_version, roots, skip)
    if not args.no_self:
        repo = Path(__file__).resolve().parent.parent
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(args.out),
                        str(repo)], check=True)
    wheels = list(args.out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"wheelhouse: {args.out} ({len(wheels)} wheels, {size:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
