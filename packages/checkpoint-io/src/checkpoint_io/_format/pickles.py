"""What a pickle names and how it uses torch's storage classes, read without running it."""

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


def _storage_class(module: str, name: str) -> bool:
    return module.split(".", maxsplit=1)[0] == "torch" and name.endswith("Storage")


class _Storage:
    """A storage class on the simulated stack, or a tuple that holds one."""


def storage_outside_reference(pickled: bytes) -> bool:
    """Whether a pickle uses a torch storage class other than inside a storage reference.

    ``torch.save`` names a storage class only as the type in a persistent id (a tuple that
    ``BINPERSID`` hands to the loader, which reads the storage from its own record). torch's
    ``weights_only`` unpickler also admits calling ``torch.storage.UntypedStorage`` and
    ``TypedStorage``: ``UntypedStorage(n)`` allocates ``n`` uninitialized bytes, and a tensor
    rebuilt over one holds memory the process freed (or gigabytes) instead of saved values.
    The stack is simulated (``pickletools``' own stack effects): a storage class, or a tuple
    holding one, may be put in a tuple, memoized, dropped or handed to ``BINPERSID``, and
    nothing else (called, built, appended, returned).

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
        held = any(isinstance(item, _Storage) for item in taken)
        if held and name not in _TUPLES and name not in _DROPS and name != "BINPERSID":
            return True
        if name in _STRINGS:
            stack.append(str(arg))
        elif name == "GLOBAL":
            module, _, attribute = str(arg).partition(" ")
            stack.append(_Storage() if _storage_class(module, attribute) else None)
        elif name == "STACK_GLOBAL":
            module_name, attribute_name = taken
            named = isinstance(module_name, str) and isinstance(attribute_name, str)
            storage = named and _storage_class(str(module_name), str(attribute_name))
            stack.append(_Storage() if storage else None)
        else:
            produced = _Storage() if held and name in _TUPLES else None
            stack.extend(produced for _ in opcode.stack_after)
    return False
