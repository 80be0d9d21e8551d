"""A byte-bounded LRU map: ``maxsize`` in bytes, ``getsizeof`` per value, eviction by recency."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Not thread-safe by itself; the owning tier holds a lock around it.

    ``put`` returns the evicted entries so the caller can spill them outside its lock.
    """

    def __init__(self, maxsize: int, getsizeof: Callable[[V], int]) -> None:
        self.maxsize = maxsize
        self.currsize = 0
        self._getsizeof = getsizeof
        self._data: OrderedDict[str, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def keys(self) -> list[str]:
        return list(self._data)

    def get(self, key: str) -> V | None:
        """Return the value and mark it most recently used, or ``None``."""
        item = self._data.get(key)
        if item is None:
            return None
        self._data.move_to_end(key)
        return item[0]

    def put(self, key: str, value: V) -> list[tuple[str, V]] | None:
        """Insert; return the evicted entries, or ``None`` if ``value`` can never fit."""
        size = self._getsizeof(value)
        self.pop(key)  # a replaced value is not an eviction; a refused one must not stay
        if size > self.maxsize:
            return None
        evicted: list[tuple[str, V]] = []
        while self.currsize + size > self.maxsize and self._data:
            old_key, (old_value, old_size) = self._data.popitem(last=False)
            self.currsize -= old_size
            evicted.append((old_key, old_value))
        self._data[key] = (value, size)
        self.currsize += size
        return evicted

    def pop(self, key: str) -> V | None:
        item = self._data.pop(key, None)
        if item is None:
            return None
        self.currsize -= item[1]
        return item[0]

    def clear(self) -> list[tuple[str, V]]:
        items = [(k, v) for k, (v, _) in self._data.items()]
        self._data.clear()
        self.currsize = 0
        return items
