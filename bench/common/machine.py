"""The machine a benchmark ran on, said once for every bench: CPU model,
family and model numbers, cores and load average. Every figure depends on
them (oneDNN against MKL's sgemm differs by CPU family; the machine may be
shared), so scripts/bench.sh prints them before each bench's lines and the
comparison lines (compare.py, zero/report.py, gpt's and pipeline's own)
carry them.

    machine.py NAME      prints "# machine: ..." and
                         {"bench": NAME, "machine": {...}} (scripts/bench.sh)
    from machine import machine   the same dict, for a bench's JSON lines
"""
import json
import os
import sys


def _cpuinfo_field(text, name):
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return "?"


def machine():
    """{"cpu", "family", "model", "cores", "load"}; "?" where /proc says nothing
    (a non-Linux machine)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    cpu = _cpuinfo_field(text, "model name")
    # The cores this process may use (nproc's count), not every core of the host.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    return {"cpu": "unknown CPU" if cpu == "?" else cpu, "family": _cpuinfo_field(text, "cpu family"),
            "model": _cpuinfo_field(text, "model"), "cores": cores, "load": load}


def describe(m):
    return f"{m['cpu']} (family {m['family']} model {m['model']}), {m['cores']} cores, load average {m['load']}"


if __name__ == "__main__":
    m = machine()
    print("# machine: " + describe(m))
    print(json.dumps({"bench": sys.argv[1] if len(sys.argv) > 1 else "?", "machine": m}), flush=True)
