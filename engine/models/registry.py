"""The model families the engine runs, by `general.architecture`.

Each family's module registers itself when `engine.models` is imported; `family(arch)` is the
one place an architecture name is looked up.  Nothing outside `engine/models/` branches on it
(tests/test_model_registry.py holds that)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.models.family import Family
from engine.models.spec import ModelSpec

if TYPE_CHECKING:  # imported without torch (the CLI's parser lists the families)
    import torch

    from engine.models.kv import LayerState

_FAMILIES: dict[str, Family] = {}


class UnknownFamily(KeyError):
    """An architecture no registered family runs; the message lists the ones that are."""

    def __init__(self, arch: object) -> None:
        self.arch = arch
        super().__init__(arch)

    def __str__(self) -> str:
        return f"unsupported architecture {self.arch!r} (supported: {', '.join(names())})"


def register(fam: Family) -> Family:
    """Add a family (its module calls this at import); a second family of one name is refused."""
    if fam.arch in _FAMILIES and _FAMILIES[fam.arch] is not fam:
        raise ValueError(f"model family {fam.arch!r} is registered twice")
    _FAMILIES[fam.arch] = fam
    return fam


def unregister(arch: str) -> None:
    """Remove a family (tests that register a throwaway one)."""
    _FAMILIES.pop(arch, None)


def names() -> tuple[str, ...]:
    """Every registered architecture, in registration order."""
    return tuple(_FAMILIES)


def family(arch: str) -> Family:
    try:
        return _FAMILIES[arch]
    except (KeyError, TypeError):
        raise UnknownFamily(arch) from None


def family_of(spec: ModelSpec) -> Family:
    return family(spec.arch)


def new_states(spec: ModelSpec, layers: Iterable[int], capacity: int, device: torch.device | str,
               dtype: torch.dtype) -> list[LayerState]:
    """One state per layer in `layers` (the runtime's per-stage `kvs`), for `capacity` tokens
    (none for no layers, whatever `spec` is: a stage may hold no layer)."""
    import torch

    layers = list(layers)
    if not layers:
        return []
    fam, dev = family_of(spec), torch.device(device)
    return [fam.new_state(spec, i, capacity, dev, dtype) for i in layers]


def states_bytes(spec: ModelSpec, layers: Iterable[int], tokens: int, dtype: torch.dtype) -> int:
    """Bytes of `new_states(spec, layers, tokens, ...)`: the allocator's and the memory plan's figure."""
    layers = list(layers)
    return family_of(spec).state_bytes(spec, layers, tokens, dtype) if layers else 0
