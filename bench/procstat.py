"""Reading a process's CPU time and peak memory from /proc (Linux only)."""

from __future__ import annotations

import contextlib
import os

__all__ = ["cpu_seconds", "machine_busy_seconds", "peak_rss_kib", "reset_peak_rss"]

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid``, in seconds.

    From the scheduler's per-thread run time (nanoseconds) when the kernel has schedstat:
    utime/stime are sampled at the clock tick, which on a busy machine can miss a process
    that runs in short bursts (a relay does) and has read 0 for a whole window. Falls back
    to utime + stime. A thread that exits inside a window takes its time with it; the
    hops' threads live as long as the process.
    """
    try:
        total_ns = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                total_ns += int(f.read().split()[0])
        return total_ns / 1e9
    except (OSError, ValueError, IndexError):
        return _tick_cpu_seconds(pid)


def _tick_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        raw = f.read()
    # The command name (field 2) may contain spaces; the fields after its closing ')' do not.
    fields = raw[raw.rindex(")") + 2 :].split()
    # After the name: state is index 0, so utime (field 14) is index 11 and stime index 12.
    return (int(fields[11]) + int(fields[12])) / _TICKS


def peak_rss_kib(pid: int) -> int | None:
    """VmHWM: the resident-set high-water mark since start or the last reset."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (clear_refs "5"), so a peak belongs to one run."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
        return True
    return False


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat.

    Busy minus our own processes' CPU is what something else on the machine took during a
    run (another test suite, say): the harness reports it so a disturbed run can be seen.
    """
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    return (user + nice + system + irq + softirq) / _TICKS, steal / _TICKS
