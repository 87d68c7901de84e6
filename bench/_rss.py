"""Time and peak memory of one child process.

``run_isolated(cmd, log)`` returns the wall seconds, exit code and peak resident set size (bytes) of ``cmd``
(its stdout and stderr go to the file ``log``), and the sampled peaks of its anonymous and file-backed parts.
It starts a small wrapper (this file run as a script), which starts ``cmd`` and reaps it with ``os.wait4``:
that gives the resource usage of that one child (and of the descendants it waited for), unlike
``getrusage(RUSAGE_CHILDREN)``, a maximum over every child ever reaped.

Why the wrapper: Linux carries the high-water RSS of the address space a process had before ``exec`` into
its ``ru_maxrss``, and Python starts children with ``vfork`` (sharing the parent's address space until the
``exec``), so a child started directly from a big benchmark process reports at least that process's peak.
Started from the wrapper, a child can only inherit the wrapper's (a bare interpreter, about 12 MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any


def _rss_split(pid: int) -> tuple[int, int] | None:
    """(RssAnon, RssFile) of ``pid`` in bytes from /proc, or None once it has exited (or off Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile")))
        return int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssFile"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def run_measured(cmd: Sequence[str], log: str, sample_s: float = 0.002) -> dict[str, Any]:
    """``cmd`` as a direct child of this process (see the module docstring for what its RSS includes).
    ``peak_rss_bytes`` is the kernel's exact high-water mark; ``peak_anon_bytes`` / ``peak_file_bytes``, the
    largest anonymous memory (heap, tensors) and file-backed resident pages (mapped files, libraries) seen
    by sampling /proc every ``sample_s`` seconds, tell them apart (a spike shorter than that can be missed)."""
    peak_anon = peak_file = 0
    with open(log, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            split = _rss_split(proc.pid)
            if split is not None:
                peak_anon, peak_file = max(peak_anon, split[0]), max(peak_file, split[1])
            time.sleep(sample_s)
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait again
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"seconds": seconds, "rc": proc.returncode, "peak_rss_bytes": usage.ru_maxrss * scale,
            "peak_anon_bytes": peak_anon, "peak_file_bytes": peak_file}


def run_isolated(cmd: Sequence[str], log: str) -> dict[str, Any]:
    """``cmd`` started by a fresh wrapper process, so its peak RSS is its own."""
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), result, log, "--", *cmd], check=True)
        with open(result) as f:
            return json.load(f)
    finally:
        os.remove(result)


if __name__ == "__main__":
    result_path, log_path, sep, *command = sys.argv[1:]
    assert sep == "--", "usage: _rss.py RESULT.json LOG -- command..."
    with open(result_path, "w") as f:
        json.dump(run_measured(command, log_path), f)
