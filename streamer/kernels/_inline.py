"""numba's IR inliner, made to prepare each inlined function once per process instead of once per call site.

The kernels inline their helpers as numba IR (`inline="always"`: the format-specialised blocks need the format
constant to reach the helpers' branches before typing, see specialise.py). For every call site numba runs the
untyped front end over the helper again (bytecode to IR, and the helper's own inlining of its helpers, each
copied again) and then deep-copies the result into the caller. A helper inlined at eight sites was prepared
eight times, and its own helpers 8 x their sites.

install() memoises InlineWorker.run_untyped_passes: the first call for a function (under the same compiler
contexts and flags) runs numba's passes; later calls return a shallow copy of that IR with a fresh function
identity, whose unique name numba uses to rename the inlined variables, so two inlined copies never share
names. The inliner deep-copies that IR before it changes anything (numba's own rule: "Always copy the callee IR,
it gets mutated"), so the kept IR stays as the passes left it (2026-12-06: the demo's compile 0.83x the CPU
time). On a numba without the method this expects, install() does nothing and numba compiles as it would.
"""

from numba.core import inline_closurecall

MEMO: dict = {}  # (function, ssa, pipeline, contexts, flags) -> the IR numba's untyped passes made of it


def install() -> None:
    """Memoise the inliner's untyped passes (once per process)."""
    cls = getattr(inline_closurecall, "InlineWorker", None)
    run = getattr(cls, "run_untyped_passes", None)
    if run is None or getattr(cls, "_stream_run_memo", False):
        return

    def run_untyped_passes(self, func, enable_ssa=False):
        # the IR depends on the function, the pipeline and contexts, and the flags (printed: Flags has no hash)
        key = (func, enable_ssa, self._compiler_pipeline, id(self.typingctx), id(self.targetctx), str(self.flags))
        kept = MEMO.get(key)
        if kept is None:
            kept = MEMO[key] = run(self, func, enable_ssa)
        else:
            self.flags.enable_ssa = enable_ssa  # what numba's passes set on the shared flags, as they would
        out = kept.copy()  # new blocks dict and Block objects; inline_ir deep-copies them before any change
        out.func_id = kept.func_id.derive()  # a fresh unique name for the inlined variables
        return out

    cls.run_untyped_passes, cls._stream_run_memo = run_untyped_passes, True
