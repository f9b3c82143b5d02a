"""The ``lru`` load strategy's memory budget: what loaded models count, and which idle ones to evict.

Pure decisions, no event loop: :mod:`batcher.repository` asks :meth:`MemoryBudget.victims` before a load and
unloads what it names.

Eviction rule (size-aware LRU, kept simple): only *idle* models are candidates - loaded, with no request in
flight, none queued and none waiting for their load (such a model is pinned). To free ``F`` bytes:

1. if some candidates are each large enough alone (budget bytes >= ``F``), evict the least recently used of
   them - one eviction where plain LRU could take two smaller models;
2. otherwise evict candidates in least-recently-used order until ``F`` bytes are free.

If the candidates together cannot free ``F``, nothing is evicted and the load is refused (503 naming the budget,
the need and the pinned models). A newcomer larger than the whole budget is refused as such (:class:`TooLarge`): no
eviction can ever make room for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

MiB = 1 << 20

K = TypeVar("K")


@dataclass(frozen=True)
class Candidate(Generic[K]):
    """A loaded model as the budget sees it: what it counts (bytes) and when it was last used (monotonic s)."""

    key: K
    nbytes: int
    last_used: float


class NoRoom(Exception):
    """The budget cannot hold the newcomer beside the pinned models; ``args[0]`` says why."""


class TooLarge(NoRoom):
    """The newcomer alone exceeds the whole budget: no eviction can make room for it."""


def choose_victims(candidates: Sequence[Candidate[K]], free_bytes: int) -> list[K]:
    """The idle models to evict so that ``free_bytes`` more bytes fit (the module's rule).

    Returns:
        keys in eviction order; ``[]`` when ``free_bytes <= 0``.

    Raises:
        NoRoom: the candidates together hold less than ``free_bytes``.
    """
    if free_bytes <= 0:
        return []
    big_enough = [c for c in candidates if c.nbytes >= free_bytes]
    if big_enough:
        return [min(big_enough, key=lambda c: c.last_used).key]
    chosen, freed = [], 0
    for c in sorted(candidates, key=lambda c: c.last_used):
        chosen.append(c.key)
        freed += c.nbytes
        if freed >= free_bytes:
            return chosen
    raise NoRoom(f"the idle models hold {freed / MiB:.0f} MB, {free_bytes / MiB:.0f} MB must be freed")


class MemoryBudget:
    """``server.memory_budget_mb`` in bytes and the admission check for one newcomer."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes

    def victims(self, name: str, need: int, used_by_others: int, candidates: Sequence[Candidate[K]],
                pinned: Sequence[str]) -> list[K]:
        """What to evict before loading model ``name`` that counts ``need`` bytes.

        Args:
            used_by_others: bytes counted by every other loaded (or unloading) model.
            candidates: the idle models (evictable).
            pinned: descriptions of the models that cannot be evicted, for the message.

        Raises:
            TooLarge: the newcomer alone exceeds the budget. NoRoom: the idle models cannot free enough.
        """
        budget = self.budget_bytes
        if need > budget:
            raise TooLarge(f"model '{name}' needs {need / MiB:.0f} MB, more than the whole memory budget "
                           f"({budget / MiB:.0f} MB)")
        try:
            return choose_victims(candidates, used_by_others + need - budget)
        except NoRoom:
            raise NoRoom(
                f"memory budget {budget / MiB:.0f} MB: model '{name}' needs {need / MiB:.0f} MB, "
                f"{used_by_others / MiB:.0f} MB are held by models with requests in flight: {list(pinned)}") from None
