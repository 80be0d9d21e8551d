"""First-fit sub-allocator of one byte range: offsets out, offsets back, free neighbours merged.

Pure bookkeeping (no memory, no torch), so its contract is tested on its own: a range is never
handed out twice, nothing lies outside ``[0, size_bytes)``, and freeing everything merges the
free list back into one range.
"""

from __future__ import annotations

import bisect


class Arena:
    """Free ranges of ``[0, size_bytes)`` as a sorted list of ``(offset, size)`` pairs.

    Not thread-safe by itself: the pool that owns it holds a lock around every call.
    """

    def __init__(self, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError(f"an arena needs a positive size, got {size_bytes}")
        self.size_bytes = size_bytes
        self.free_bytes = size_bytes
        self._offsets: list[int] = [0]  # sorted; parallel to _sizes
        self._sizes: list[int] = [size_bytes]

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a fresh range of ``nbytes`` (first fit), or ``None`` when none is free."""
        if nbytes <= 0:
            raise ValueError(f"allocate a positive number of bytes, got {nbytes}")
        for i, size in enumerate(self._sizes):
            if size >= nbytes:
                offset = self._offsets[i]
                if size == nbytes:
                    del self._offsets[i], self._sizes[i]
                else:
                    self._offsets[i] += nbytes
                    self._sizes[i] -= nbytes
                self.free_bytes -= nbytes
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give a range back; it merges with free neighbours. A range that overlaps free
        space or leaves the arena is a bug (a double free) and raises ``ValueError``."""
        end = offset + nbytes
        if nbytes <= 0 or offset < 0 or end > self.size_bytes:
            raise ValueError(f"range [{offset}, {end}) is not inside [0, {self.size_bytes})")
        i = bisect.bisect_left(self._offsets, offset)
        before = i - 1
        if before >= 0 and self._offsets[before] + self._sizes[before] > offset:
            raise ValueError(f"range [{offset}, {end}) is already free (double free)")
        if i < len(self._offsets) and self._offsets[i] < end:
            raise ValueError(f"range [{offset}, {end}) is already free (double free)")
        merge_before = before >= 0 and self._offsets[before] + self._sizes[before] == offset
        merge_after = i < len(self._offsets) and self._offsets[i] == end
        if merge_before and merge_after:
            self._sizes[before] += nbytes + self._sizes[i]
            del self._offsets[i], self._sizes[i]
        elif merge_before:
            self._sizes[before] += nbytes
        elif merge_after:
            self._offsets[i] = offset
            self._sizes[i] += nbytes
        else:
            self._offsets.insert(i, offset)
            self._sizes.insert(i, nbytes)
        self.free_bytes += nbytes

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ``(offset, size)`` ranges, in address order (for tests and stats)."""
        return list(zip(self._offsets, self._sizes, strict=True))

    def largest_free(self) -> int:
        return max(self._sizes, default=0)
