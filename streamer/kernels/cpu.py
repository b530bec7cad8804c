"""What the host CPU can run, as LLVM sees it: the features numba compiles the kernels for (and keys its cache
on), read once."""

from functools import cache

from llvmlite import binding as llvm

from streamer.machine import numba_cpu_features

X86 = llvm.get_process_triple().startswith("x86_64")


@cache
def features() -> frozenset[str]:
    """LLVM's names of the features the kernels are compiled for ('avx2', 'avx512f', 'avx512vnni', ...): the
    host's, or NUMBA_CPU_FEATURES ("+avx2,+fma,-avx512f,..."), which numba then compiles for instead (with it
    set, say to an AVX2-only CPU's list, a kernel for a feature not listed would not compile)."""
    told = numba_cpu_features()
    if told is not None:
        return told
    return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)


def has(*names: str) -> bool:
    """Whether the host is x86 and has every one of these features (all asked for here are x86's)."""
    return X86 and features().issuperset(names)


def vector_registers() -> int:
    """The host's vector registers: 16 on x86 without AVX-512 (ymm0-15), else 32 (zmm0-31; NEON's v0-31)."""
    return 16 if X86 and not has("avx512f") else 32
