"""Which submodules get their own ``fully_shard`` call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from strategy_config import did_you_mean

ShardPolicy = Callable[[nn.Module], bool] | Sequence[type[nn.Module] | str]


def select_shard_targets(module: nn.Module, shard: ShardPolicy | None) -> list[nn.Module]:
    """The submodules (never the root) that ``shard`` selects, children before parents.

    ``fully_shard`` must be applied bottom-up, so the list is in reverse pre-order: a selected
    module always comes after every selected module inside it.

    Args:
        module: The root module.
        shard: ``None``: each member of every ``nn.ModuleList`` (transformer blocks). A callable
            ``(submodule) -> bool``. Or a sequence of classes and/or class names.

    Returns:
        The selected submodules, each once.

    Raises:
        TypeError: If ``shard`` has another type, or holds something that is neither a
            class nor a string.
        ValueError: If a class name in ``shard`` matches no submodule (the names present are
            listed, with the closest one).
    """
    named = [(name, sub) for name, sub in module.named_modules() if sub is not module]
    if shard is None:
        lists = [sub for _, sub in named if isinstance(sub, nn.ModuleList)]
        members = {id(child) for lst in lists for child in lst.children()}
        chosen = [sub for _, sub in named if id(sub) in members]
    elif callable(shard) and not isinstance(shard, type):
        chosen = [sub for _, sub in named if shard(sub)]
    elif isinstance(shard, Sequence) and not isinstance(shard, str | bytes):
        chosen = [sub for _, sub in named if _matches(sub, _check_entries(shard, named))]
    else:
        raise TypeError(
            "shard must be None, a callable (submodule) -> bool, or a sequence of classes or "
            f"class names, got {type(shard).__name__} ({shard!r}); e.g. shard=['Block'] or "
            "shard=[Block]"
        )
    return list(reversed(chosen))


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
