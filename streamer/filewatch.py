"""Guards against the model file changing under a running process.

Weights are used in place from a read-only mapping of the file. If the file is truncated or rewritten in
place while we run, pages past the new end raise SIGBUS when touched and rewritten pages silently change
the weights. Two defences:
- FileWatch.check(), called before every forward pass, compares the open file's size and modification time
  with what they were at open: a change between steps becomes a ModelFileChanged error (one clear line).
- install_bus_error_exit() replaces the default SIGBUS action (the interpreter dies with "Bus error") by a
  native handler that prints one line and exits with code 2; it catches a truncation in the middle of a step.
  The handler is a few instructions of LLVM IR (write + _exit, both async-signal-safe), compiled with
  llvmlite (numba's own backend), because a Python-level handler cannot run while a numba kernel faults.
A file replaced by rename (cp new && mv new model.gguf) is harmless: the process keeps the old inode.
"""

from __future__ import annotations

import ctypes
import os
import signal
import weakref

from streamer.errors import ModelFileChanged


class FileWatch:
    """Size and modification time of every file of the model (each shard of a split model), checked per step."""

    def __init__(self, paths: str | list[str]):
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        self.path = self.paths[0]
        self.fds: list[int] = []
        self.close = weakref.finalize(self, _close_all, self.fds)  # at close(), GC or exit
        self.seen = []
        for p in self.paths:
            self.fds.append(os.open(p, os.O_RDONLY))
            st = os.fstat(self.fds[-1])
            self.seen.append((st.st_size, st.st_mtime_ns))

    def check(self) -> None:
        for path, fd, (size, mtime) in zip(self.paths, self.fds, self.seen):
            st = os.fstat(fd)
            if st.st_size != size:
                raise ModelFileChanged(
                    f"{path} changed size while in use ({size} -> {st.st_size} bytes); "
                    f"stopping (restart on the new file)"
                )
            if st.st_mtime_ns != mtime:
                raise ModelFileChanged(f"{path} was rewritten while in use; stopping (restart on the new file)")


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


_handlers: dict = {}  # path -> (engine, address): keeps each compiled handler alive, compiled once per path


def install_bus_error_exit(path: str) -> None:
    """On SIGBUS (a mapped page of `path` vanished: truncated under us), print one error line, exit 2. `path`
    is only words in that line: a split model gives "<first shard> (or one of its N shards)"."""
    if path not in _handlers:
        _handlers[path] = _compile_handler(path)
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signal.SIGBUS, _handlers[path][1])


def _compile_handler(path: str):
    """(engine, address) of a native `void on_sigbus(int)` that writes the error line and calls _exit(2)."""
    from llvmlite import binding as llvm, ir  # numba's compiler: loaded when a handler is installed, not on import

    msg = f"error: {path} was truncated or changed while in use (bus error reading its mapping)\n".encode(
        "utf-8", "replace"
    )
    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    mod = ir.Module(name="stream_run_sigbus")
    text = ir.GlobalVariable(mod, ir.ArrayType(i8, len(msg)), "msg")
    text.global_constant, text.linkage = True, "private"
    text.initializer = ir.Constant(ir.ArrayType(i8, len(msg)), bytearray(msg))
    write = ir.Function(mod, ir.FunctionType(i64, [i32, i8.as_pointer(), i64]), "write")
    _exit = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i32]), "_exit")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i32]), "on_sigbus")
    b = ir.IRBuilder(fn.append_basic_block())
    b.call(write, [i32(2), b.bitcast(text, i8.as_pointer()), i64(len(msg))])
    b.call(_exit, [i32(2)])
    b.unreachable()

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    parsed = llvm.parse_assembly(str(mod))
    engine = llvm.create_mcjit_compiler(parsed, llvm.Target.from_default_triple().create_target_machine())
    engine.finalize_object()
    return engine, engine.get_function_address("on_sigbus")
