"""Observing a method of a type defined in C, in place: the type and its instances stay what they
are (``torch.Event``'s ``query``; the lock types' ``acquire`` and ``release``)."""

from __future__ import annotations

from collections.abc import Callable

from kvverify.errors import RecordingError


def patch_method(cls: type, name: str, fn: Callable, original) -> Callable[[], None]:
    """Put ``fn`` in place of ``cls.<name>`` (``original``) in the type's own dictionary, for a type
    defined in C whose attributes cannot be set (``torch.Event``); returns what undoes it.

    The dictionary is reached as the one object ``cls.__dict__`` (a read-only proxy) refers to,
    and ``PyType_Modified`` drops the interpreter's method cache for the type, as setting an
    attribute would. Every instance keeps its type, so C++ checks of the exact type still pass.
    ``fn`` carries ``original``'s name and docstring. Raises RecordingError where the dictionary
    cannot be reached this way (an interpreter other than CPython).
    """
    import ctypes
    import gc

    found = [d for d in gc.get_referents(cls.__dict__) if isinstance(d, dict) and d.get(name) is original]
    if len(found) != 1:
        raise RecordingError(f"cannot reach the dictionary of {cls.__qualname__} to observe {name}(): "
                             "this interpreter does not expose it as CPython does")
    table = found[0]
    modified = ctypes.pythonapi.PyType_Modified
    modified.argtypes = [ctypes.py_object]
    fn.__name__, fn.__qualname__, fn.__doc__ = name, f"{cls.__qualname__}.{name}", original.__doc__
    table[name] = fn
    modified(cls)

    def undo() -> None:
        table[name] = original
        modified(cls)

    return undo
