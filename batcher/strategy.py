"""Routing strategies (``routing.strategy``): which of several queues a request goes to. Pure, no event loop.

A request can go to several queues when its model has several served versions and it names none (``weighted``
and ``hash`` spread such requests over the versions, e.g. a canary), or when the version is placed on several
GPUs (multi-process mode has one engine process, so one queue, per GPU). Each candidate is a :class:`Target`.

* ``least_queue`` (default): the target with the least queued work - requests waiting or running there - ties
  to the first (so at low load one GPU serves alone and its batches fill).
* ``weighted``: smooth weighted round robin (nginx's ``ngx_http_upstream_get_peer``): over any run of
  ``sum(weights)`` picks each target is picked exactly ``weight`` times, interleaved (weights 3:1 -> a a b a).
* ``hash``: weighted rendezvous hashing (highest random weight) of a request key: one key always lands on one
  target while the targets stay the same; removing a target moves only its keys; a target's share of keys
  follows its weight. BLAKE2b of the key (Python's ``hash`` is salted per process and front ends are processes).
  A request without the key goes as ``least_queue`` would.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

LEAST_QUEUE, WEIGHTED, HASH = "least_queue", "weighted", "hash"


@dataclass(frozen=True)
class Target:
    """A queue a request may go to.

    Attributes:
        id: stable name of the target (e.g. ``"resnet18/1@gpu0"``); the hash strategy hashes it with the key.
        weight: its ``weight`` (the sum over its instance groups); 0 takes no weighted or hashed requests.
        load: queued work there now (requests waiting or running); only ``least_queue`` reads it.
    """

    id: str
    weight: float = 1.0
    load: float = 0.0


def least_queue(targets: Sequence[Target]) -> int:
    """Index of the target with the least load (the first of equals)."""
    return min(range(len(targets)), key=lambda i: targets[i].load)


def _unit(key: str, target_id: str) -> float:
    """A uniform number in (0, 1) from ``key`` and ``target_id``, the same in every process."""
    # surrogateescape: a header's bytes that are not UTF-8 (aiohttp decodes them so) hash as those bytes, not a 500
    digest = hashlib.blake2b(f"{target_id}\0{key}".encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64


def rendezvous(key: str, targets: Sequence[Target]) -> int:
    """Index of the target that weighted rendezvous hashing gives ``key`` (score ``-weight / ln(u)``)."""
    best, best_score = 0, -math.inf
    for i, t in enumerate(targets):
        if t.weight <= 0:
            continue
        score = -t.weight / math.log(_unit(key, t.id))
        if score > best_score:
            best, best_score = i, score
    return best


class SmoothWeighted:
    """Smooth weighted round robin over target sets, each remembered by a group key (e.g. the model name)."""

    def __init__(self) -> None:
        self._current: dict[Hashable, dict[str, float]] = {}

    def pick(self, group: Hashable, targets: Sequence[Target]) -> int:
        """Index of the next target of ``group`` (all weights 0: the first)."""
        current = self._current.setdefault(group, {})
        total = 0.0
        best = -1
        for i, t in enumerate(targets):
            if t.weight <= 0:
                continue
            current[t.id] = current.get(t.id, 0.0) + t.weight
            total += t.weight
            if best < 0 or current[t.id] > current[targets[best].id]:
                best = i
        if best < 0:
            return 0
        current[targets[best].id] -= total
        return best


class Strategy:
    """One of the three strategies, with its state (the weighted strategy's round-robin position per group)."""

    def __init__(self, name: str = LEAST_QUEUE) -> None:
        if name not in (LEAST_QUEUE, WEIGHTED, HASH):
            raise ValueError(f"unknown routing strategy {name!r}")
        self.name = name
        self._wrr = SmoothWeighted()

    def spreads(self, key: str | None) -> bool:
        """Whether a request that names no version may go to any served version: weighted always, hash when the
        request has its key; otherwise it goes to the model's default version."""
        return self.name == WEIGHTED or (self.name == HASH and key is not None)

    def choose(self, group: Hashable, targets: Sequence[Target], key: str | None = None) -> int:
        """Index of the target for one request of ``group`` (the model); ``key`` is its hash key, if any.

        Raises:
            ValueError: no targets.
        """
        if not targets:
            raise ValueError("no target to route to")
        if len(targets) == 1:
            return 0
        if self.name == WEIGHTED:
            return self._wrr.pick(group, targets)
        if self.name == HASH and key is not None:
            return rendezvous(key, targets)
        return least_queue(targets)
