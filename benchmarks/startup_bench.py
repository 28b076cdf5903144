"""Time the CLI's start-up: ``autoshard --help``, ``python -m autoshard --help``, ``autoshard inspect PLAN``.

Each command runs as a fresh subprocess (what a user waits for: interpreter
start, imports, parsing, output to a pipe); one untimed warm-up run fills
the OS file cache, then ``--runs`` timed runs give the median, min and max.
Target: every median under 1 s on a 2-core CPU (``autoshard/cli.py``'s
module docstring: nothing imports torch unless the command needs it).

The plan ``inspect`` reads is made first, in a temporary directory, with
``autoshard plan gpt:tiny --cluster cpu:1x2`` (not timed). Writes JSON
(``--out``, default ``benchmarks/results/startup_<date>.json``) and prints a
line per command. Run from the repository root:
``.venv/bin/python benchmarks/startup_bench.py [--runs N] [--machine TEXT]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_S = 1.0


def autoshard_script() -> str:
    """The ``autoshard`` console script of this interpreter's environment."""
    script = pathlib.Path(sys.executable).parent / "autoshard"
    if not script.exists():
        raise SystemExit(f"{script} is missing: install the package (pip install -e .) in this environment")
    return str(script)


def time_command(argv: list[str], runs: int) -> list[float]:
    """Wall seconds of ``runs`` runs of ``argv`` (after one warm-up); a failing run stops the benchmark."""
    samples = []
    for index in range(runs + 1):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        if index:
            samples.append(seconds)
    return samples


def make_plan(folder: pathlib.Path) -> pathlib.Path:
    """A small plan to inspect: gpt:tiny on two CPU ranks."""
    path = folder / "plan.json"
    subprocess.run([autoshard_script(), "--quiet", "plan", "gpt:tiny", "--cluster", "cpu:1x2", "--batch", "8",
                    "--seq", "64", "-o", str(path)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return path


def torch_imported_by_cli() -> bool:
    """Whether ``import autoshard.cli`` imports torch (it should not)."""
    code = "import autoshard.cli, sys; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return done.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="timed runs per command (default 9)")
    parser.add_argument("--machine", default=f"{os.cpu_count()}-core CPU", help="what ran it, for the record")
    parser.add_argument("--out", type=pathlib.Path,
                        help="JSON to write (default benchmarks/results/startup_<date>.json)")
    args = parser.parse_args()
    date = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"startup_{date}.json"
    script = autoshard_script()
    with tempfile.TemporaryDirectory(prefix="autoshard-startup-") as folder:
        plan = make_plan(pathlib.Path(folder))
        commands = {
            "autoshard --help": [script, "--help"],
            "python -m autoshard --help": [sys.executable, "-m", "autoshard", "--help"],
            "autoshard inspect PLAN": [script, "inspect", str(plan)],
            "autoshard inspect PLAN --json": [script, "inspect", str(plan), "--json"],
        }
        rows = []
        for name, argv in commands.items():
            samples = time_command(argv, args.runs)
            median = statistics.median(samples)
            rows.append({"command": name, "median_s": round(median, 4), "min_s": round(min(samples), 4),
                         "max_s": round(max(samples), 4), "samples_s": [round(s, 4) for s in samples],
                         "under_target": median < TARGET_S})
            print(f"{name:32s} median {median:.3f} s  (min {min(samples):.3f}, max {max(samples):.3f}, "
                  f"{args.runs} runs)")
    record = {
        "benchmark": "cli start-up", "date": date, "machine": args.machine, "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "platform": platform.platform(), "runs": args.runs,
        "target_s": TARGET_S, "torch_imported_by_cli": torch_imported_by_cli(), "commands": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
