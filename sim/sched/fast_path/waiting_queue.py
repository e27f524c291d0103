"""The scheduler's waiting queue, counting the calls that may put an entry
in it: the fast path's rule 11 reads the count (``missed_lookups.py``).

No twin in vLLM (its waiting queue is a plain ``deque``); kvsim's is one,
plus the count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any


class WaitingQueue(deque):
    """The waiting queue: a deque that counts the calls that may put an
    entry in (``insertions``: every mutating method of ``deque``,
    ``MUTATORS``, but ``REMOVALS``, which only take entries out). The fast
    path reads it (its rule 11; ~1,000 waiters on an async saturated
    decode): with none since, every entry was in the queue then, in its
    order (an admission pops the head), so no entry need be compared.
    ``tests/test_values_fast_path.py`` checks the list against ``deque``
    itself."""

    MUTATORS = (
        "append",
        "appendleft",
        "clear",
        "extend",
        "extendleft",
        "insert",
        "pop",
        "popleft",
        "remove",
        "reverse",
        "rotate",
        "__setitem__",
        "__delitem__",
        "__iadd__",
        "__imul__",
    )
    REMOVALS = ("clear", "pop", "popleft", "remove", "__delitem__")

    def __init__(self, iterable: Iterable[Any] = (), maxlen: int | None = None) -> None:
        # Called again on a queue, ``__init__`` refills it: counted too.
        self.insertions = getattr(self, "insertions", -1) + 1
        super().__init__(iterable, maxlen)


def _counted(name: str) -> Callable[..., Any]:
    change = getattr(deque, name)

    def counted(self: WaitingQueue, *args: Any) -> Any:
        self.insertions += 1
        return change(self, *args)

    counted.__name__ = counted.__qualname__ = name
    return counted


for _name in set(WaitingQueue.MUTATORS) - set(WaitingQueue.REMOVALS):
    setattr(WaitingQueue, _name, _counted(_name))
