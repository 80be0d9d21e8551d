"""Redis writes in a child process, fed through shared memory.

An engine's worker process runs vLLM's step loop on its main thread; a Redis write made on a
thread there (encoding, checksumming, redis-py's socket calls) needs the GIL hundreds of times
per item and competes with that loop for it. Here the write runs in a child process of its own
(``child.py``): the parent's writer thread copies the item's bytes into a memory file both
processes map (``arena.py``, one copy that releases the GIL), sends one small message over a
private socket (``wire.py``) and sleeps until the reply. Per item the parent takes the GIL a
handful of times; the child takes none of the parent's.

Where the child may read its parent's memory (``peek.py``: ``process_vm_readv``), the
engine's own thread hands a write over instead (``sink.dispatch``, from ``put`` or at the end
of its step): one message naming where the bytes are, no copy, no thread woken. The engine's
thread collects the reply itself once it is in, without blocking (``sink.settle``); a writer
thread collects it when it needs more (a retry) or is left out too long, and whoever needs
the child first collects it.

Everything else stays where it was: the bounded queue, coalescing, read-your-writes and the
lost-write handling (``writer.py``); the versioned atomic entry and the breaker (the child's
own ``RedisTier``, which also ends the leases of dropped writes); the counters, which the
child sends back as per-write deltas and the parent adds to its own tier's (counted once).

A child gets another item only after a valid reply to its last request: one that dies,
hangs, answers out of turn or is left with a request out by any error in the parent is killed
and reaped before its arena is touched again (``process.py``), and the write is retried once
in a fresh child; Redis never shows half of it (the entry's head is swapped in only after
every chunk landed). Idle children that die are reaped at once (``watch.py``). A write no
child can take costs nothing but the GIL: it runs on the parent's thread as it did before,
counted. That covers a child that cannot start (no ``memfd``, no free descriptor, a broken
interpreter), one that runs other ec_redis code than its parent (``handshake.py``: it
refuses), children that keep dying (``backoff.py``: starts back off) and a request too
large for the socket (a very long item id, ``wire.py``).
"""
