"""The state of the machine beside a benchmark's figures: the CPU and its vector ISA, the memory free and
available, the transparent-huge-page and free-page-reporting settings, and the kernel's page-fault and reclaim
counters over the run. On virtual machines these move the timings as much as the code does (a guest that
reports freed memory to its host refaults it at first touch), so `bench` records them with every result.
Linux files only; on other systems the fields are None."""

from __future__ import annotations

import os
from pathlib import Path

VMSTAT_KEYS = ("pgfault", "pgmajfault", "thp_fault_alloc", "pgscan_kswapd", "pgscan_direct", "compact_stall")
REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING: the guest tells the host which pages are free


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cpuinfo() -> tuple[str | None, set[str]]:
    text = _read("/proc/cpuinfo") or ""
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def isa_name(flags: set[str]) -> str | None:
    """The vector ISA the kernels can use, as the project names it: 'AVX-512/VNNI', 'AVX-512', 'AVX2 only'."""
    if "avx512f" in flags:
        return "AVX-512/VNNI" if "avx512_vnni" in flags else "AVX-512"
    if "avx2" in flags:
        return "AVX2 only"
    return None


def numba_cpu_features() -> frozenset[str] | None:
    """The features NUMBA_CPU_FEATURES turns on (LLVM's names: "+avx2,+fma,-avx512f,..."), or None where it is not
    set: numba then compiles for these instead of the host's, and kernels/cpu.py follows it."""
    told = os.environ.get("NUMBA_CPU_FEATURES")
    return frozenset(f[1:] for f in told.split(",") if f.startswith("+")) if told else None


def kernel_isa(cpu_isa: str | None) -> str | None:
    """The ISA the kernels are compiled for: the CPU's, unless NUMBA_CPU_FEATURES names another feature set, e.g.
    to run an AVX2 machine's paths here."""
    told = numba_cpu_features()
    if told is None:
        return cpu_isa
    return f"{isa_name({f.replace('avx512vnni', 'avx512_vnni') for f in told}) or 'no AVX2'} (NUMBA_CPU_FEATURES)"


def _thp(name: str) -> str | None:
    """The bracketed (active) choice of a transparent_hugepage setting."""
    text = _read(f"/sys/kernel/mm/transparent_hugepage/{name}")
    if text is None or "[" not in text:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def free_page_reporting() -> bool | None:
    """Whether a virtio balloon device negotiated free page reporting (None: no balloon device)."""
    devices = Path("/sys/bus/virtio/drivers/virtio_balloon")
    try:
        feats = [(d / "features").read_text().strip() for d in devices.glob("virtio*")]
    except OSError:
        return None
    if not feats:
        return None
    return any(len(f) > REPORTING_BIT and f[REPORTING_BIT] == "1" for f in feats)


def vmstat() -> dict[str, int]:
    """The kernel's counters in VMSTAT_KEYS (those this kernel has)."""
    out = {}
    for line in (_read("/proc/vmstat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key in VMSTAT_KEYS:
            out[key] = int(value)
    return out


REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"  # free page reporting's running total


def cpu_times(text: str | None = None) -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs from /proc/stat's first line (or `text`): steal is the time the
    hypervisor ran something else while this guest wanted the CPU."""
    text = _read("/proc/stat") if text is None else text
    first = (text or "").partition("\n")[0].split()
    if len(first) < 9 or first[0] != "cpu":
        return None
    ticks = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal (guest ticks are in user)
    return ticks[7], sum(ticks)


def reported_kib() -> int | None:
    text = _read(REPORTED_KIB)
    return int(text) if text and text.strip().isdigit() else None


def meminfo() -> dict[str, int]:
    """MemTotal, MemFree and MemAvailable in bytes."""
    out = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemFree", "MemAvailable"):
            out[key] = int(value.split()[0]) * 1024
    return out


def describe() -> dict:
    """The machine now: CPU, ISA, CPUs this process may use, memory, THP and free page reporting, vmstat."""
    model, flags = _cpuinfo()
    return {
        "cpu": model,
        "isa": isa_name(flags),
        "kernel_isa": kernel_isa(isa_name(flags)),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory": meminfo(),
        "thp_enabled": _thp("enabled"),
        "thp_defrag": _thp("defrag"),
        "free_page_reporting": free_page_reporting(),
        "vmstat": vmstat(),
        "cpu_times": cpu_times(),
        "reported_kib": reported_kib(),
    }


def during(before: dict) -> dict:
    """Since describe() returned `before`: the vmstat counters' growth, the share of CPU time stolen by the
    hypervisor (steal_share) and the memory free page reporting handed back to the host meanwhile (MiB)."""
    now = vmstat()
    out: dict = {k: now[k] - v for k, v in before["vmstat"].items() if k in now}
    t0, t1 = before.get("cpu_times"), cpu_times()
    if t0 and t1 and t1[1] > t0[1]:
        out["steal_share"] = round((t1[0] - t0[0]) / (t1[1] - t0[1]), 4)
    r0, r1 = before.get("reported_kib"), reported_kib()
    if r0 is not None and r1 is not None:
        out["reported_mib"] = round((r1 - r0) / 1024, 1)
    return out


def line(state: dict, delta: dict | None = None) -> str:
    """One line for a benchmark's text output."""
    mem = state["memory"]
    gib = 2**30
    parts = [
        f"{state['cpu'] or 'unknown CPU'} ({state['isa'] or 'no AVX2'}), {state['cpus']} CPUs"
        + (f", kernels for {state['kernel_isa']}" if state.get("kernel_isa", state["isa"]) != state["isa"] else "")
        + (f", activations as {state['activation_digits']} int8 digit(s)" if "activation_digits" in state else ""),
        f"{mem.get('MemAvailable', 0) / gib:.1f} of {mem.get('MemTotal', 0) / gib:.1f} GiB available "
        f"({mem.get('MemFree', 0) / gib:.1f} free) at the start",
        f"THP {state['thp_enabled']}/{state['thp_defrag']}",
        "free page reporting " + {True: "on", False: "off", None: "n/a"}[state["free_page_reporting"]],
    ]
    if delta:
        parts.append(
            f"during the run, machine-wide: {delta.get('pgfault', 0)} page faults ({delta.get('pgmajfault', 0)} major)"
            + (f", CPU steal {100 * delta['steal_share']:.1f}%" if "steal_share" in delta else "")
            + (f", {delta['reported_mib']:.0f} MiB reported to the host" if "reported_mib" in delta else "")
        )
    return "; ".join(parts)
