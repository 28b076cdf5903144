"""What a program's build and steps held at their peaks, measured (``Program.memory_report``).

On CUDA the caching allocator counts: ``BuildMemory`` resets the device's
peak statistics when the build starts, reads ``max_memory_allocated`` when it
ends (the build peak, including whatever was allocated before the build, e.g.
the user's model, reported as ``start_bytes``), and resets the peak again, so
``step_peak_bytes`` is the peak since the build (the training steps). On the
CPU the build is measured only with ``track_memory=True``: ``LiveBytes``
counts the storages created during the build (so ``start_bytes`` is 0) and no
step peak is measured. The cost model's prediction of the same quantities is
``plan.predictions.build_peak_bytes`` and ``peak_memory_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.live_bytes import LiveBytes


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank held (module docstring); ``None`` where not measured on this device."""

    device: str
    start_bytes: int | None  # allocated when the build started
    build_peak_bytes: int | None  # peak during the build
    resident_bytes: int | None  # allocated when the build ended (shards, masters, moments)
    step_peak_bytes: int | None  # peak since the build ended (CUDA)

    def gib(self) -> dict[str, float | None]:
        """The byte fields in GiB, for logs."""
        return {k: None if v is None else v / 2**30 for k, v in self.__dict__.items() if k.endswith("bytes")}


class BuildMemory:
    """Measures a build (``with BuildMemory(device, track):``); ``report()`` afterwards (module docstring)."""

    def __init__(self, device: torch.device, track_cpu: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.tracker = LiveBytes() if track_cpu and not self.cuda else None
        self.start = self.peak = self.resident = None

    def __enter__(self) -> BuildMemory:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        elif self.tracker is not None:
            self.tracker.__enter__()
            self.start = 0
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.resident = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.tracker is not None:
            self.tracker.__exit__(*exc)
            self.peak, self.resident = self.tracker.peak, self.tracker.live

    def report(self) -> MemoryReport:
        """The build's figures and, on CUDA, the peak since the build."""
        step = torch.cuda.max_memory_allocated(self.device) if self.cuda else None
        return MemoryReport(device=str(self.device), start_bytes=self.start, build_peak_bytes=self.peak,
                            resident_bytes=self.resident, step_peak_bytes=step)


__all__ = ["BuildMemory", "MemoryReport"]
