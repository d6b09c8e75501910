"""What a run's time means: its wall time, the process's CPU time, the machine's load while it
ran, and whether the time ratio of two policies can be trusted.

Runs of a comparison execute one after another (or side by side, as Ray tasks); the wall time
of each also measures whatever else the machine did meanwhile. On a machine loaded by other
work, ``make demo`` once printed 16-mixed far faster than fp32, where it is slower
(benchmarks/RESULTS.md, figure F19). So every epoch records, beside its wall time
(:class:`EpochMeter`):

* ``cpu_seconds``: the CPU time of the training process (``time.process_time``: every thread,
  user and system) over the same span;
* ``load``: the machine's 1-minute load average (``os.getloadavg``), mean of samples taken at
  the start, at most once a second, and at the end. It is damped over a minute and counts this
  run's own threads, so it lags (a comparison's first run starts on an idle average);
* ``other_cpus``: the cores other processes kept busy meanwhile, measured, not damped: the
  machine's busy CPU time from ``/proc/stat`` over the epoch, less this process's CPU time,
  divided by the wall time (None where ``/proc/stat`` is not readable: not Linux).

:func:`compare_load` decides whether two policies' time ratio compares like with like. It is
**not comparable** (flagged in the report, not used by the verdict) when, over either policy's
epochs (means weighted by time),

* **other processes took CPU the runs needed**: ``other_cpus`` exceeds the cores the run's
  threads left free (``cpus - threads``) by more than ``LOAD_DIFF_MAX`` (0.5 core). With 2
  threads on 2 cores beside more than a core of other work, the same 1-epoch run's wall and CPU
  times both changed severalfold from one run to the next (threads spinning while a sibling
  waits for a core; benchmarks/RESULTS.md, figure F20): under contention neither clock
  measures the policy; or
* **the two saw different load**: their ``other_cpus`` differ by more than ``LOAD_DIFF_MAX``.

Where ``other_cpus`` was not recorded, the 1-minute load averages stand in (the load average
counts the run's own threads: contended when it exceeds ``cpus`` by more than 0.5). The
process CPU time ratio is shown beside the wall-time ratio as a hint: it does not count time
spent waiting for a core, but it does count threads spinning meanwhile.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["EpochMeter", "LoadComparison", "compare_load", "busy_cpu_seconds", "loadavg",
           "LOAD_DIFF_MAX", "overlapping_runs"]

#: cores of other work by which two policies' runs may differ before their time ratio is
#: flagged as not comparable
LOAD_DIFF_MAX = 0.5
#: at most one load-average sample per this many seconds (it changes every 5 s)
_SAMPLE_EVERY = 1.0


def loadavg() -> float | None:
    """The machine's 1-minute load average, None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot, summed over its CPUs (Linux's
    ``/proc/stat``: user, nice, system, irq, softirq, steal; guest time is inside user), None
    where it cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        if fields[0] != b"cpu":
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class EpochMeter:
    """Wall time, process CPU time, load average and other processes' cores of one span:
    ``start()``, ``sample()`` as often as convenient (cheap: it reads the load average at most
    once a second), ``stop()`` -> dict of ``seconds``, ``cpu_seconds``, ``load``,
    ``other_cpus``, ``ended``."""

    def start(self) -> "EpochMeter":
        self.t0 = time.perf_counter()
        self.c0 = time.process_time()
        self.b0 = busy_cpu_seconds()
        first = loadavg()
        self.loads = [] if first is None else [first]
        self.last_sample = self.t0
        return self

    def sample(self) -> None:
        now = time.perf_counter()
        if now - self.last_sample >= _SAMPLE_EVERY:
            self.last_sample = now
            v = loadavg()
            if v is not None:
                self.loads.append(v)

    def stop(self) -> dict:
        seconds = time.perf_counter() - self.t0
        cpu = time.process_time() - self.c0
        b1 = busy_cpu_seconds()
        last = loadavg()
        loads = self.loads + ([] if last is None else [last])
        other = None
        if self.b0 is not None and b1 is not None and seconds > 0:
            other = max(0.0, (b1 - self.b0) - cpu) / seconds
        return {"seconds": seconds, "cpu_seconds": cpu,
                "load": sum(loads) / len(loads) if loads else None,
                "other_cpus": other, "ended": time.time()}


@dataclass(frozen=True)
class LoadComparison:
    """Whether a time ratio compares like with like, and why (one sentence)."""

    comparable: bool
    reason: str
    measure: str | None  # "other_cpus", "load", or None (not recorded)


def _contended(x: dict, key: str, max_diff: float) -> float | None:
    """How far (cores) other work exceeded what the run's threads left free, where known."""
    v, cpus, threads = x.get(key), x.get("cpus"), x.get("threads")
    if v is None or not cpus:
        return None
    free = cpus - min(threads or cpus, cpus)
    busy = v - min(threads or cpus, cpus) if key == "load" else v  # the load counts our threads
    over = busy - free
    return over if over > max_diff else None


def compare_load(base: dict, other: dict, *, base_name: str = "32-true",
                 other_name: str = "this policy",
                 max_diff: float = LOAD_DIFF_MAX) -> LoadComparison:
    """Can the time ratio of ``other`` to ``base`` be trusted? Each is a dict of the policy's
    means over its epochs: ``other_cpus`` and ``load`` (None where not recorded), with the
    machine's ``cpus`` and the runs' ``threads``. Not comparable when other work took more
    than ``max_diff`` cores of those the runs' threads needed, on either side, or when the two
    sides' other work differs by more than ``max_diff`` (see the module's docstring); the
    load averages stand in where ``other_cpus`` is missing; where neither was recorded (a
    database of an older lowprec), comparable, saying so."""
    for key in ("other_cpus", "load"):
        a, b = base.get(key), other.get(key)
        if a is None or b is None:
            continue
        if key == "other_cpus":
            said = (f"other processes used {b:.2f} cores during {other_name}'s epochs and "
                    f"{a:.2f} during {base_name}'s")
        else:
            said = (f"the 1-minute load average was {b:.2f} during {other_name}'s epochs and "
                    f"{a:.2f} during {base_name}'s")
        for name, side in ((other_name, other), (base_name, base)):
            over = _contended(side, key, max_diff)
            if over is not None:
                return LoadComparison(False, f"{said}, on {side['cpus']} CPUs: other work took "
                                      f"{over:.2f} cores that {name}'s {side.get('threads')} "
                                      "threads needed, so the time measures the load, not the "
                                      "policy", key)
        diff = abs(b - a)
        if diff > max_diff:
            return LoadComparison(False, f"{said}: they differ by {diff:.2f} (> {max_diff:g}), "
                                  "so the time ratio measures the load, not the policy", key)
        return LoadComparison(True, f"{said} (within {max_diff:g}, on {base.get('cpus')} CPUs)",
                              key)
    return LoadComparison(True, "the load was not recorded (a database of an older lowprec)",
                          None)


def overlapping_runs(spans: dict[str, tuple[float, float]]) -> set[str]:
    """The runs whose span (start, end), in Unix time, overlaps another run's: runs that
    executed side by side (Ray tasks) and shared the CPUs of a node they shared."""
    out: set[str] = set()
    active: list[tuple[float, str]] = []  # (end, run) of the runs started so far, not ended
    for run_id, (start, end) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        active = [(e, r) for e, r in active if e > start]
        if active:
            out.add(run_id)
            out.update(r for _, r in active)
        active.append((end, run_id))
    return out
