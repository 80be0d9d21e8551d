"""Redis writes in a child process, fed through shared memory.

An engine's worker process runs vLLM's step loop on its main thread; a Redis write made on a
thread there (encoding, checksumming, redis-py's socket calls) needs the GIL hundreds of times
per item and competes with that loop for it. Here the write runs in a child process of its own
(``child.py``): the parent's writer thread copies the item's bytes into a memory file both
processes map (``arena.py``, one copy that releases the GIL), sends one small message over a
private socket (``wire.py``) and sleeps until the reply. Per item the parent takes the GIL a
handful of times; the child takes none of the parent's.

Everything else stays where it was: the bounded queue, coalescing, read-your-writes and the
lost-write handling (``writer.py``); the versioned atomic entry and the breaker (the child's
own ``RedisTier``); the counters, which the child sends back as per-write deltas and the
parent adds to its own tier's (counted once). A child that dies or hangs mid-write is
replaced; the write is retried once in a fresh child, and Redis never shows half of it (the
entry's head is swapped in only after every chunk landed). A child that cannot be started
(no ``memfd``, no free descriptor, a broken interpreter) costs nothing: the write runs on the
parent's thread as it did before, counted, and a new child is tried after a back-off.
"""
