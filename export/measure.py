"""Measure one ``specedge export`` run: peak memory, disk and time, per phase.

The export runs in a child process; this process samples the child's resident set
(``/proc/<pid>/status`` VmRSS) every ``poll_s`` seconds and reads the child's progress lines
from its stderr as they come: ``[k/n] message  (t=12s)`` starts a stage, an indented
``      message  (t=..s)`` a step within it; each starts a new phase here, so every sample
belongs to the stage or step that was running. The whole
run's peak is the kernel's own high-water mark (VmHWM, read while the child lives, and
``getrusage(RUSAGE_CHILDREN)`` after it exits), which no sampling interval can miss.

Two guards for shared machines: a child whose resident set passes ``max_rss_bytes``, or that
leaves the machine less than ``min_available_bytes`` (``/proc/meminfo`` MemAvailable), is killed
(SIGKILL) before the kernel's OOM killer picks a victim, and the measurement says so.

Standard library only.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_STAGE = re.compile(r"^\[(\d+)/(\d+)\] (.*?)\s+\(t=\d+s\)\s*$")
_NOTE = re.compile(r"^ {6}(\S.*?)\s+\(t=\d+s\)\s*$")


@dataclass
class Phase:
    name: str
    start_s: float  # seconds since the child started
    seconds: float = 0.0
    peak_rss_bytes: int = 0  # the highest sampled VmRSS while this phase ran


@dataclass
class Measurement:
    command: list[str]
    returncode: int
    seconds: float
    peak_rss_bytes: int  # the child's high-water mark (kernel-kept, exact)
    phases: list[Phase]
    out_bytes: int  # the bundle's size on disk after the run
    peak_scratch_bytes: int  # the most bytes the export's .partial folder held at one sample
    cache_bytes_added: int  # growth of the specedge cache (converted copies left behind)
    killed_over_limit: bool = False
    stderr_tail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def report(self) -> str:
        gb = 1e9
        lines = [f"{'phase':58s} {'seconds':>8s} {'peak RSS GB':>12s}"]
        for p in self.phases:
            lines.append(f"{p.name[:58]:58s} {p.seconds:8.1f} {p.peak_rss_bytes / gb:12.2f}")
        lines.append(f"total: {self.seconds:.1f} s, peak RSS {self.peak_rss_bytes / gb:.2f} GB (VmHWM), "
                     f"bundle {self.out_bytes / gb:.2f} GB, peak scratch {self.peak_scratch_bytes / gb:.2f} GB, "
                     f"cache +{self.cache_bytes_added / gb:.2f} GB, exit {self.returncode}"
                     + (" (KILLED: over the RSS limit or the machine's memory ran low)" if self.killed_over_limit else ""))
        return "\n".join(lines)


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while walking
                pass
    return total


def _status_bytes(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (a large number where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 1 << 62


def parse_progress(line: str) -> str | None:
    """The phase an export progress line starts: ``[k/n] name`` for a stage, ``  name`` for a step
    within one; None for any other line."""
    line = line.rstrip("\n")
    stage = _STAGE.match(line)
    if stage:
        return f"[{stage.group(1)}/{stage.group(2)}] {stage.group(3)}"
    note = _NOTE.match(line)
    return f"  {note.group(1)}" if note else None


def measure_export(export_args: list[str], out: Path, *, cache: Path | None = None, poll_s: float = 0.2,
                   max_rss_bytes: int | None = None, min_available_bytes: int = 1 << 30, echo: bool = True) -> Measurement:
    """Run ``specedge export <export_args>`` (which must write to ``out``) and measure it."""
    command = [sys.executable, "-c", "from specedge.cli.main import main; main()", "export", *export_args]
    cache_before = folder_bytes(cache) if cache is not None else 0
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, bufsize=1)
    phases = [Phase("start", 0.0)]
    tail: list[str] = []
    lock = threading.Lock()

    def read_stderr() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            if echo:
                sys.stderr.write(line)
            tail.append(line)
            del tail[:-40]
            name = parse_progress(line)
            if name is not None:
                with lock:
                    phases.append(Phase(name, time.perf_counter() - started))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    peak_hwm = peak_scratch = 0
    killed = False
    scratch_glob = f".{out.name}.partial-*"
    last_disk = 0.0
    while child.poll() is None:
        rss = _status_bytes(child.pid, "VmRSS")
        peak_hwm = max(peak_hwm, _status_bytes(child.pid, "VmHWM"))
        with lock:
            phases[-1].peak_rss_bytes = max(phases[-1].peak_rss_bytes, rss)
        if (max_rss_bytes is not None and rss > max_rss_bytes) or available_bytes() < min_available_bytes:
            os.kill(child.pid, signal.SIGKILL)
            killed = True
        now = time.perf_counter()
        if now - last_disk > 2.0:  # walking the scratch folder costs more than reading /proc
            last_disk = now
            peak_scratch = max([peak_scratch] + [folder_bytes(p) for p in out.parent.glob(scratch_glob)])
        time.sleep(poll_s)
    child.wait()
    reader.join(timeout=5)
    seconds = time.perf_counter() - started
    peak = max(peak_hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    for here, after in zip(phases, phases[1:] + [None]):
        here.seconds = (after.start_s if after is not None else seconds) - here.start_s
    return Measurement(command=command, returncode=child.returncode, seconds=round(seconds, 1),
                       peak_rss_bytes=peak, phases=phases, out_bytes=folder_bytes(out),
                       peak_scratch_bytes=peak_scratch,
                       cache_bytes_added=(folder_bytes(cache) - cache_before) if cache is not None else 0,
                       killed_over_limit=killed, stderr_tail="".join(tail))
