"""What a pickle names, and where it puts classes that must not be called; read, not run."""

from __future__ import annotations

import pickletools
from collections.abc import Iterator

_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_TUPLES = frozenset({"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"})
_DROPS = frozenset({"POP", "POP_MARK"})


def pickle_globals(pickled: bytes) -> Iterator[tuple[str, str] | None]:
    """``(module, name)`` of every global a pickle names, in order, without running it.

    ``None`` for a global whose name cannot be read from the stream (``INST``, ``OBJ``, a
    ``STACK_GLOBAL`` without two strings before it).

    Raises:
        Exception: Whatever ``pickletools`` raises for a malformed pickle.
    """
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(pickled):
        if opcode.name in _STRINGS:
            strings.append(str(arg))
        elif opcode.name == "GLOBAL":
            module, _, name = str(arg).partition(" ")
            yield module, name
        elif opcode.name == "STACK_GLOBAL":
            yield (strings[-2], strings[-1]) if len(strings) >= 2 else None
        elif opcode.name in ("INST", "OBJ"):
            yield None


def _never_called(module: str, name: str) -> bool:
    """A class that ``weights_only`` admits and that, called, makes memory of any size."""
    storage = module.split(".", maxsplit=1)[0] == "torch" and name.endswith("Storage")
    return storage or (module, name) == ("torch", "Tensor")


_REBUILD_FROM_TYPE = ("torch._tensor", "_rebuild_from_type_v2")
"""``_rebuild_from_type_v2(func, new_type, args, state)``: torch.save names ``torch.Tensor``
here, as ``new_type`` (a tensor with Python attributes); it calls ``func(*args)``."""


class _Global:
    """A global on the simulated stack."""

    def __init__(self, module: str, name: str) -> None:
        self.name = (module, name)


class _Class(_Global):
    """A class that must not be called (:func:`_never_called`) on the simulated stack."""


class _Holds:
    """A tuple that holds a :class:`_Class`: where it is, directly, and whether deeper."""

    name: tuple[str, str]
    """The first class it holds, for the message."""

    def __init__(self, items: list[object]) -> None:
        self.direct = {i: item.name for i, item in enumerate(items) if isinstance(item, _Class)}
        self.deeper = any(isinstance(item, _Holds) for item in items)
        self.name = next(item.name for item in items if isinstance(item, _Class | _Holds))


def _global(module: object, name: object) -> object:
    if not isinstance(module, str) or not isinstance(name, str):
        return None
    return _Class(module, name) if _never_called(module, name) else _Global(module, name)


def _as_torch_saves(name: str, taken: list[object]) -> bool:
    """Whether an op that takes a never-called class is one torch.save's pickles make."""
    if name in _TUPLES or name in _DROPS or name == "BINPERSID":
        return True  # a storage reference's type, in the tuple handed to BINPERSID
    if name != "REDUCE":
        return False
    function, arguments = taken
    return (
        isinstance(function, _Global)
        and function.name == _REBUILD_FROM_TYPE
        and isinstance(arguments, _Holds)
        and not arguments.deeper
        and arguments.direct == {1: ("torch", "Tensor")}
    )


def class_called(pickled: bytes) -> str | None:
    """A class that a pickle uses other than as ``torch.save`` does, or ``None``.

    torch's ``weights_only`` unpickler admits calling ``torch.storage.UntypedStorage``,
    ``TypedStorage`` and ``torch.Tensor``: ``UntypedStorage(n)`` allocates ``n``
    uninitialized bytes, and a tensor rebuilt over one holds memory the process freed (or
    gigabytes) instead of saved values. ``torch.save`` names a storage class only as the type
    in a persistent id (a tuple that ``BINPERSID`` hands to the loader, which reads the storage
    from its own record), and ``torch.Tensor`` only as ``_rebuild_from_type_v2``'s
    ``new_type``. The stack is simulated (``pickletools``' own stack effects): such a class,
    or a tuple holding one, may be put in a tuple, memoized, dropped or handed to
    ``BINPERSID``, ``torch.Tensor`` may be that ``new_type``, and nothing else (called,
    built, appended, returned).

    Raises:
        Exception: Whatever ``pickletools`` raises for a malformed pickle, and ``IndexError``
            for one whose stack runs out (torch's unpickler refuses both).
    """
    stack: list[object] = []
    marks: list[int] = []
    memo: dict[object, object] = {}
    for opcode, arg, _ in pickletools.genops(pickled):
        name = opcode.name
        if name == "MARK":
            marks.append(len(stack))
            continue
        if name in _PUTS or name == "MEMOIZE":
            memo[arg if name in _PUTS else len(memo)] = stack[-1]
            continue
        if name in _GETS:
            stack.append(memo.get(arg))
            continue
        if name == "DUP":
            stack.append(stack[-1])
            continue
        before = [item.name for item in opcode.stack_before]
        taken: list[object] = []
        if "mark" in before:
            begin = marks.pop()
            taken = stack[begin:]
            del stack[begin:]
            before = before[: before.index("mark")]
        if before:
            taken = stack[-len(before) :] + taken
            del stack[-len(before) :]
        if len(taken) < len(before):
            raise IndexError(f"{name} finds the stack empty")
        held = [item for item in taken if isinstance(item, _Class | _Holds)]
        if held and not _as_torch_saves(name, taken):
            module, attribute = held[0].name
            return f"{module}.{attribute}"
        if name in _STRINGS:
            stack.append(str(arg))
        elif name == "GLOBAL":
            module, _, attribute = str(arg).partition(" ")
            stack.append(_global(module, attribute))
        elif name == "STACK_GLOBAL":
            stack.append(_global(*taken))
        elif name == "INST":
            module, _, attribute = str(arg).partition(" ")
            if _never_called(module, attribute):
                return f"{module}.{attribute}"
            stack.append(None)
        else:
            produced = _Holds(taken) if held and name in _TUPLES else None
            stack.extend(produced for _ in opcode.stack_after)
    return None
