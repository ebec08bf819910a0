"""Triton's interpreter, without re-patching the language at every helper call (tests only).

Under `TRITON_INTERPRET=1` a kernel launch patches `triton.language` for the launch, and every call
of a jit'd *device* function inside it (`tl.sum`, `tl.max`, `tl.cumsum` are such functions in
triton.language.standard; so are the kernels' own helpers) patches the language of that function's
module again, scanning each module with `inspect.getmembers`: about a third of an interpreted
decode's time (a cProfile of `tests/test_hot_path.py`'s Triton decode, triton 3.9). A device
call's patches are never undone, so after the first call for a module within a launch the others
change nothing. `install()` keeps that first call and skips the repeats; the functions that run are
the ones the interpreter rewrote, with the same arguments. It applies only where the interpreter's
device call is the code it was written against (`_patch_lang(self.fn)`, then `self.rewrite()`),
otherwise it leaves triton as it is. Compiled kernels (a GPU) never go through it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect


def install() -> bool:
    """Patch triton's interpreter in this process; True when it was (idempotent)."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    device_call, launch = ti.InterpretedFunction.__call__, ti.GridExecutor.__call__
    if getattr(device_call, "_psd_once", False):
        return True
    try:
        src = inspect.getsource(device_call)
    except (OSError, TypeError):
        return False
    if "_patch_lang(self.fn)" not in src or "self.rewrite()" not in src or not hasattr(ti, "InterpreterError"):
        return False
    patched: set[int] = set()         # modules whose language this launch has patched

    @functools.wraps(launch)
    def launch_once(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    @functools.wraps(device_call)
    def call_once(self, *args, **kwargs):
        key = id(self.fn.__globals__)
        if key not in patched:
            patched.add(key)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    call_once._psd_once = True
    call_once._psd_plain = (launch, device_call)
    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = launch_once, call_once
    return True


@contextlib.contextmanager
def plain():
    """Triton's own interpreter inside the block (where install() patched it)."""
    from triton.runtime import interpreter as ti

    quick = (ti.GridExecutor.__call__, ti.InterpretedFunction.__call__)
    orig = getattr(quick[1], "_psd_plain", None)
    if orig is not None:
        ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = orig
    try:
        yield
    finally:
        ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = quick
