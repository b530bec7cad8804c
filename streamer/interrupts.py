"""Ctrl-C at safe points. Python raises KeyboardInterrupt in the main thread at whatever bytecode it runs when SIGINT
arrives; inside threading.Condition.notify (queue.put: asking an expert reader for a read) that can leave a notified
waiter in the condition's list, so the reader pool's close waits forever (seen 2026-12-05). A forward pass therefore
runs under deferred(): a first Ctrl-C is held and raised by the next check(), at a layer boundary, where every expert
request has been released; a second Ctrl-C before that raises at once (a read that never returns must not make the
program deaf). Only the main thread gets SIGINT, and only there is a handler installed; elsewhere, or when the
program installed its own handler, deferred() is a no-op."""

import signal
import threading
from contextlib import contextmanager

_depth = 0  # nested deferred() scopes entered with our handler installed
_pending = False  # a Ctrl-C held for the next check()


def _hold(signum, frame) -> None:
    global _pending
    if _depth and not _pending:
        _pending = True
        return
    _pending = False
    raise KeyboardInterrupt


def check() -> None:
    """Raise the KeyboardInterrupt a deferred() scope held back, if any."""
    global _pending
    if _pending:
        _pending = False
        raise KeyboardInterrupt


@contextmanager
def deferred():
    """Hold a Ctrl-C that arrives inside until check() (or the end of the scope) raises it."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread() or (
        _depth == 0 and signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    outermost = _depth == 0
    previous = signal.signal(signal.SIGINT, _hold) if outermost else None
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        held = False
        if outermost:  # an exception on its way out carries on; a Ctrl-C held meanwhile goes with it
            signal.signal(signal.SIGINT, previous)
            held, _pending = _pending, False
    if held:  # not raised by a check() before the scope ended
        raise KeyboardInterrupt
