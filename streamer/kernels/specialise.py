"""Kernels compiled per weight format: a model compiles only the formats it uses.

A kernel that serves many formats takes the format's code as an argument (`fmt`, first by convention) and branches on
it; compiled for a runtime code, it holds every format's row dot. `format_kernel` makes such a kernel a FormatKernel:
called from Python, each distinct tuple of format codes gets its own numba dispatcher (`specialise`), compiled with
those arguments typed as integer literals. A compiler pass turns the literal arguments into constants before numba's
dead-branch pruning, so `if fmt == Q4_K:` chains keep the one branch taken, and blocks.py's overloads (prepare, dot,
dot2) select the format's code at typing time. The specialisations share the kernel's on-disk cache (the signature holds
the literal codes). Called from another kernel with constant codes, the kernel is typed with the literal codes too and
shares the same compiled version.

Only the commonest formats are compiled apart (SPECIALISED: Q8_0, the packaged demo's; Q4_K and Q6_K, which make up
Q4_K_M and Q6_K files; and -1, moe_block's float router): any other code calls the kernel's every-format version,
compiled once for all of them. Each specialisation is a compile of its own, and the test suite runs all 23 formats
through every kernel: Q4_0 and Q5_K were dropped from the list when CI neared its 20 minutes (2026-12-01)."""

from __future__ import annotations

import inspect
import warnings

from numba.core import compiler, errors, ir, sigutils, types
from numba.core.compiler_lock import global_compiler_lock
from numba.core.compiler_machinery import FunctionPass, register_pass
from numba.core.ir_utils import build_definitions
from numba.core.registry import CPUDispatcher
from numba.core.untyped_passes import IRProcessing

from ..formats import Q4_K, Q6_K, Q8_0

SPECIALISED = frozenset({Q8_0, Q4_K, Q6_K, -1})  # block format codes compiled apart (and no router)

# numba's pedantic SSA check flags blocks._rows2's loop-carried pair once it is inlined as IR ("variable ... is not
# in scope"): a note for numba's developers, printed in the middle of a user's first run otherwise.
warnings.filterwarnings("ignore", category=errors.NumbaIRAssumptionWarning)


@register_pass(mutates_CFG=False, analysis_only=False)
class LiteralArgsToConsts(FunctionPass):
    """Replace each integer-literal argument's value by an IR constant (before dead-branch pruning)."""

    _name = "stream_run_literal_args_to_consts"

    def __init__(self):
        FunctionPass.__init__(self)

    def run_pass(self, state):
        changed = False
        for blk in state.func_ir.blocks.values():
            for stmt in blk.body:
                if isinstance(stmt, ir.Assign) and isinstance(stmt.value, ir.Arg):
                    ty = state.args[stmt.value.index]
                    if isinstance(ty, types.IntegerLiteral):
                        stmt.value = ir.Const(ty.literal_value, stmt.value.loc)
                        changed = True
        if changed:
            state.func_ir._definitions = build_definitions(state.func_ir.blocks)
        return changed


class SpecCompiler(compiler.CompilerBase):
    """numba's nopython pipeline with LiteralArgsToConsts after the IR is built."""

    def define_pipelines(self):
        pm = compiler.DefaultPassBuilder.define_nopython_pipeline(self.state)
        pm.add_pass_after(LiteralArgsToConsts, IRProcessing)
        pm.finalize()
        return [pm]


class Specialised(CPUDispatcher):
    """One FormatKernel's dispatcher for fixed format codes: compiles with those arguments typed as literals and
    is called with the plain ints (their machine-code value is unused)."""

    def __init__(self, parent: FormatKernel, codes: tuple[int, ...]):
        super().__init__(parent.py_func, locals={}, targetoptions=parent.targetoptions, pipeline_class=SpecCompiler)
        self.parent, self.codes = parent, codes
        self._lits = {i: types.literal(c) for i, c in zip(parent.format_args, codes)}
        self.enable_caching()

    def compile(self, sig):
        args, return_type = sigutils.normalize_signature(sig)
        args = tuple(self._lits.get(i, a) for i, a in enumerate(args))
        with global_compiler_lock:
            if _share(self.parent, self, args):
                return self.overloads[args].entry_point
            return super().compile(args if return_type is None else return_type(*args))

    def add_overload(self, cres):
        args = tuple(cres.signature.args)
        self._insert([types.unliteral(a)._code for a in args], cres.entry_point, cres.objectmode)
        self.overloads[args] = cres

    def in_cache(self) -> bool:
        """Whether numba's on-disk cache holds machine code of this specialisation (for some argument types)."""
        index = self._cache._cache_file._load_index()
        return any(all(key[0][i] == lit for i, lit in self._lits.items()) for key in index)


class FormatKernel(CPUDispatcher):
    """A numba kernel whose format-code arguments select its compiled code (see the module's docstring). As a
    global called from other kernels it is an ordinary dispatcher; called from Python it calls
    specialise(its codes)."""

    def __init__(self, py_func, params: tuple[str, ...], targetoptions: dict, every: bool = False):
        super().__init__(py_func, locals={}, targetoptions=targetoptions, pipeline_class=SpecCompiler)
        names = list(inspect.signature(py_func).parameters)
        self.format_args = tuple(names.index(p) for p in params)
        self.every = every  # every code compiled apart (the float kernels: one format each), else SPECIALISED's
        self.specs: dict[tuple[int, ...], Specialised] = {}
        self.enable_caching()

    def specialise(self, *codes: int) -> Specialised | FormatKernel:
        """The dispatcher of this kernel for these format codes (one per format argument, in order): their
        specialisation, or this kernel itself (its every-format version) if a code is not in SPECIALISED."""
        key = tuple(int(c) for c in codes)
        spec = self.specs.get(key)
        if spec is None:
            if not (self.every or SPECIALISED.issuperset(key)):
                return self
            spec = self.specs[key] = Specialised(self, key)
        return spec

    def __call__(self, *args):
        spec = self.specs.get(tuple([args[i] for i in self.format_args]))
        if spec is None:
            spec = self.specialise(*[args[i] for i in self.format_args])
            if spec is self:
                return super().__call__(*args)
        return spec(*args)

    def compile(self, sig):
        """numba's compile, but a call from another kernel typed with literal codes takes the machine code their
        specialisation already has for these exact types (the Python-facing and the callee versions are one
        compile: without this the second dispatcher loaded a copy from numba's cache)."""
        args, _ = sigutils.normalize_signature(sig)
        args = tuple(args)
        with global_compiler_lock:
            lits = [args[i] for i in self.format_args]
            if all(isinstance(a, types.IntegerLiteral) for a in lits):
                spec = self.specs.get(tuple(a.literal_value for a in lits))
                if spec is not None and _share(spec, self, args):
                    return self.overloads[args].entry_point
            return super().compile(sig)

    def in_cache(self) -> bool:
        """Whether numba's on-disk cache holds machine code of the every-format version (for some argument types)."""
        index = self._cache._cache_file._load_index()
        return any(not any(isinstance(key[0][i], types.Literal) for i in self.format_args) for key in index)

    @property
    def signatures(self) -> list:
        """The compiled signatures of this kernel and of its specialisations (whose format arguments are literals),
        each once (a version shared by the kernel and a specialisation is one compile)."""
        sigs = [*super().signatures, *(sig for spec in self.specs.values() for sig in spec.signatures)]
        return list(dict.fromkeys(sigs))

    def dispatchers(self) -> list:
        """This kernel's dispatcher and its specialisations'."""
        return [self, *self.specs.values()]


def _share(src: CPUDispatcher, dst: CPUDispatcher, args: tuple) -> bool:
    """Give dst src's compiled version for exactly these argument types, if src has one; whether dst has it now.
    Only an exact match: a dispatcher would otherwise serve other argument types by conversion."""
    if args in dst.overloads:
        return True
    cres = src.overloads.get(args)
    if cres is None:
        return False
    dst.add_overload(cres)
    return True


def format_kernel(*params: str, every: bool = False, **options):
    """Decorator: a FormatKernel whose format arguments are `params` (default "fmt"), compiled like _bits.kernel
    (cached, numpy's error model, no GIL) with these numba options; every: each code compiled apart (not only
    SPECIALISED's)."""
    targetoptions = {"nopython": True, "error_model": "numpy", "nogil": True, **options}

    def wrap(py_func):
        return FormatKernel(py_func, params or ("fmt",), targetoptions, every)

    return wrap
