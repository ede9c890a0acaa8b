"""Which submodules get their own ``fully_shard`` call."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from torch import nn

from strategy_config import did_you_mean

ShardPolicy = Callable[[nn.Module], bool] | Sequence[type[nn.Module] | str]


def select_shard_targets(module: nn.Module, shard: ShardPolicy | None) -> list[nn.Module]:
    """The submodules (never the root) that ``shard`` selects, children before parents.

    ``fully_shard`` must be applied bottom-up, so the list is in reverse pre-order: a selected
    module always comes after every selected module inside it.

    The default (``shard=None``):

    1. The classes that the model declares unsplittable: the names in ``_no_split_modules``
       (Hugging Face transformers) of the model or any submodule, where they match.
    2. Otherwise the repeated blocks: in every ``nn.ModuleList`` and ``nn.Sequential``, the
       children whose class occurs at least twice there; in an ``nn.Sequential`` only
       children made of submodules themselves (``Sequential(Linear, GELU, Linear)`` is one
       MLP, not a list of blocks).

    Either way only submodules that hold parameters are selected.

    Args:
        module: The root module.
        shard: ``None`` for the default rule above. A callable ``(submodule) -> bool``. Or
            a sequence of classes and/or class names.

    Returns:
        The selected submodules, each once.

    Raises:
        TypeError: If ``shard`` has another type, or holds something that is neither a
            class nor a string.
        ValueError: If a class name in ``shard`` matches no submodule (the names present are
            listed, with the closest one).
    """
    return select_with_rule(module, shard)[0]


def select_with_rule(module: nn.Module, shard: ShardPolicy | None) -> tuple[list[nn.Module], str]:
    """:func:`select_shard_targets`, plus a short description of the rule, for the log."""
    if shard is None:
        chosen, rule = _default_units(module)
        return list(reversed(chosen)), f"default policy: {rule}"
    named = [(name, sub) for name, sub in module.named_modules() if sub is not module]
    if callable(shard) and not isinstance(shard, type):
        chosen = [sub for _, sub in named if shard(sub)]
    elif isinstance(shard, Sequence) and not isinstance(shard, str | bytes):
        entries = _check_entries(shard, named)
        chosen = [sub for _, sub in named if _matches(sub, entries)]
    else:
        raise TypeError(
            "shard must be None, a callable (submodule) -> bool, or a sequence of classes or "
            f"class names, got {type(shard).__name__} ({shard!r}); e.g. shard=['Block'] or "
            "shard=[Block]"
        )
    return list(reversed(chosen)), "shard="


def _check_entries(
    shard: Sequence[object], named: list[tuple[str, nn.Module]]
) -> tuple[tuple[type[nn.Module], ...], frozenset[str]]:
    classes: list[type[nn.Module]] = []
    names: set[str] = set()
    for entry in shard:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            classes.append(entry)
        elif isinstance(entry, str):
            names.add(entry)
        else:
            raise TypeError(
                "shard entries must be nn.Module classes or class names, got "
                f"{type(entry).__name__} ({entry!r})"
            )
    present = {type(sub).__name__ for _, sub in named}
    missing = sorted(names - present)
    if missing:
        listed = ", ".join(f"'{n}'{did_you_mean(n, present)}" for n in missing)
        raise ValueError(
            f"shard names class(es) that no submodule has: {listed}; the model's submodule "
            f"classes are {', '.join(sorted(present))}"
        )
    return tuple(classes), frozenset(names)


def _matches(sub: nn.Module, entries: tuple[tuple[type[nn.Module], ...], frozenset[str]]) -> bool:
    classes, names = entries
    return isinstance(sub, classes) or type(sub).__name__ in names


def _default_units(module: nn.Module) -> tuple[list[nn.Module], str]:
    """What ``shard=None`` selects (see :func:`select_shard_targets`), in pre-order, and why."""
    named = [(name, sub) for name, sub in module.named_modules() if sub is not module]
    declared = _declared_unsplittable(module)
    if declared:
        chosen = [sub for _, sub in named if type(sub).__name__ in declared and _has_params(sub)]
        if chosen:
            return chosen, f"_no_split_modules {sorted(declared)}"
    repeated: set[int] = set()
    for container in module.modules():
        if not isinstance(container, _BLOCK_LISTS):
            continue
        children = list(container.children())
        counts = Counter(type(child) for child in children)
        for child in children:
            if counts[type(child)] < 2 or not _has_params(child):
                continue
            if isinstance(container, nn.Sequential) and next(child.children(), None) is None:
                continue
            repeated.add(id(child))
    chosen = [sub for _, sub in named if id(sub) in repeated]
    return chosen, "repeated blocks of nn.ModuleList / nn.Sequential"


def describe_units(units: Sequence[nn.Module]) -> str:
    """``"12 x Block, 1 x Head"``: the selected units by class, most common first."""
    counts = Counter(type(unit).__name__ for unit in units)
    return ", ".join(f"{n} x {name}" for name, n in counts.most_common()) or "none"


def _declared_unsplittable(module: nn.Module) -> frozenset[str]:
    names: set[str] = set()
    for sub in module.modules():
        declared = getattr(sub, "_no_split_modules", None)
        if isinstance(declared, list | tuple | set | frozenset):
            names.update(entry for entry in declared if isinstance(entry, str))
    return frozenset(names)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


_BLOCK_LISTS = (nn.ModuleList, nn.Sequential)
