"""A PNG of what a terminal shows while an ``autoshard`` command runs (the README's live-display picture).

    pip install pyte            # a VT100 screen emulator (docs only; not a dependency of autoshard)
    python scripts/screenshot_terminal.py -o docs/img/ppo_live.png -- \
        ppo llama:tiny --cluster cpu:1x1 --task arithmetic --steps 12

Runs ``python -m autoshard ARGS`` in a pseudo-terminal (so the CLI sees a terminal and draws its live
display), replays every byte it wrote through ``pyte``'s screen emulator, and renders the final
screen as an HTML ``<pre>`` that headless Chromium (``chromium``, Debian's package) screenshots.
Nothing is drawn by hand: the picture is the emulated terminal's last frame.
"""

from __future__ import annotations

import argparse
import html
import os
import pty
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_terminal(args: list[str], columns: int, lines: int, timeout_s: float) -> bytes:
    """Everything ``python -m autoshard ARGS`` writes to a ``columns × lines`` pseudo-terminal."""
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(lines)}
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, on the terminal
        os.chdir(ROOT)
        os.execvpe(sys.executable, [sys.executable, "-m", "autoshard", *args], env)
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            os.kill(pid, 9)
            raise SystemExit(f"no output for {timeout_s:g} s; stopped")
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.stderr.write(b"".join(chunks).decode(errors="replace"))
        raise SystemExit(f"autoshard {' '.join(args)} failed")
    return b"".join(chunks)


def final_screen(output: bytes, columns: int, lines: int) -> list[str]:
    """The terminal's rows after ``output``, trailing blank rows dropped."""
    import pyte

    screen = pyte.Screen(columns, lines)
    pyte.ByteStream(screen).feed(output)
    rows = [row.rstrip() for row in screen.display]
    while rows and not rows[-1]:
        rows.pop()
    return rows


def screenshot(rows: list[str], command: str, out: Path, columns: int) -> None:
    """``rows`` as a dark terminal page, screenshotted by headless Chromium into ``out``."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium not found (apt-get install chromium)")
    body = html.escape("\n".join([f"$ autoshard {command}", *rows]))
    page = (f"<html><body style='margin:0;background:#1e1e1e'><pre style='margin:0;padding:14px;color:#e6e6e6;"
            f"font:13px/1.35 DejaVu Sans Mono,monospace'>{body}</pre></body></html>")
    width, height = int(columns * 7.9) + 30, int((len(rows) + 1) * 17.6) + 30
    with tempfile.TemporaryDirectory() as tmp:
        page_path = Path(tmp) / "terminal.html"
        page_path.write_text(page, encoding="utf-8")
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={out.absolute()}", f"--window-size={width},{height}", page_path.as_uri()],
                       check=True, capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--columns", type=int, default=110)
    parser.add_argument("--lines", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds without output before giving up")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the autoshard command's arguments")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    rows = final_screen(run_in_terminal(args, ns.columns, ns.lines, ns.timeout), ns.columns, ns.lines)
    screenshot(rows, " ".join(args), ns.out, ns.columns)
    print(f"{ns.out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
