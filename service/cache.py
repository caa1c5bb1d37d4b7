"""A small bounded in-process cache, optionally with a time to live, for facts that rarely change."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class Cache(Generic[V]):
    """Least-recently-used, at most `size` entries; `ttl` seconds per entry (None: until evicted)."""

    def __init__(self, size: int, ttl: float | None = None) -> None:
        self.size = size
        self.ttl = ttl
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def get(self, key: str) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: str, value: V) -> None:
        if self.size <= 0 or self.ttl == 0:
            return
        expires = float("inf") if self.ttl is None else time.monotonic() + self.ttl
        self._entries[key] = (expires, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)
