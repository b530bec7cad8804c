"""Kernels made per instruction set from one source (_bits.isa_kernels): each version's branches for the other
sets are pruned before typing, so a CPU without AVX512-VNNI never types a vpdpbusd intrinsic (it does not compile
there), and each version is its own named, cached kernel."""

import pytest
from numba.core import compiler, ir
from numba.core.analysis import dead_branch_prune

from streamer.kernels import int8, lanes

# each version's row kernels, by the helper names its source calls (lanes: per ISA and activation digits)
CALLS = {
    "lanes": {f"{isa}-{d}": f"_row_{isa}_{d}" for isa in lanes.ISAS for d in (1, 2)},
    "int8": {"vnni": "_gemm_vnni", "avx2": "_gemm_avx2", "generic": "_gemm_generic"},
}
KERNELS = {
    "lanes": {f"{isa}-{d}": k for (isa, d), k in lanes.GROUPED.items()},
    "int8": {**int8.KERNELS, **{f"grouped-{k}": v for k, v in int8.GROUPED.items()}},
}


def _globals_after_pruning(py_func) -> set[str]:
    """The global names the function's IR still loads once numba's dead-branch pruning has run (the untyped
    pipeline's pass, before typing) on it."""
    func_ir = compiler.run_frontend(py_func)
    dead_branch_prune(func_ir, ())
    return {
        s.value.name
        for blk in func_ir.blocks.values()
        for s in blk.find_insts(ir.Assign)
        if isinstance(s.value, ir.Global)
    }


@pytest.mark.parametrize("module", sorted(KERNELS))
def test_each_isa_version_keeps_only_its_own_row_kernels(module):
    calls = CALLS[module]
    for key, disp in KERNELS[module].items():
        kept = _globals_after_pruning(disp.py_func) & set(calls.values())
        assert kept == {calls[key if module == "lanes" else key.split("-")[-1]]}, (module, key, kept)


def test_each_isa_version_has_its_own_name():
    names = [d.py_func.__name__ for d in (*lanes.GROUPED.values(), *int8.KERNELS.values(), *int8.GROUPED.values())]
    assert len(set(names)) == len(names)
    assert int8.KERNELS["vnni"].py_func.__name__ == "i8_matmul_vnni"
    assert lanes.GROUPED["avx2", 2].py_func.__name__ == "grouped_avx2"
    assert lanes.GROUPED["avx2", 1].py_func.__name__ == "grouped_d1_avx2"
