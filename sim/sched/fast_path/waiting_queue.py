"""The scheduler's waiting queue (vLLM's is a plain ``deque``), counting the calls that
may put an entry in it (``insertions``). Rule 11 reads it: with none since an idle pin
pass, every entry met that pass, in its order, and none need be compared."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any


class WaitingQueue(deque):
    # Every changing method of ``deque``; the removals only take entries out.
    MUTATORS = tuple(
        "append appendleft clear extend extendleft insert pop popleft remove reverse rotate"
        " __setitem__ __delitem__ __iadd__ __imul__".split()
    )
    REMOVALS = ("clear", "pop", "popleft", "remove", "__delitem__")

    def __init__(self, iterable: Iterable[Any] = (), maxlen: int | None = None) -> None:
        # Called again on a queue, ``__init__`` refills it: counted too.
        self.insertions = getattr(self, "insertions", -1) + 1
        super().__init__(iterable, maxlen)


def _counted(change: Callable[..., Any]) -> Callable[..., Any]:
    def counted(self: WaitingQueue, *args: Any) -> Any:
        self.insertions += 1
        return change(self, *args)

    counted.__name__ = counted.__qualname__ = change.__name__
    return counted


for _name in set(WaitingQueue.MUTATORS) - set(WaitingQueue.REMOVALS):
    setattr(WaitingQueue, _name, _counted(getattr(deque, _name)))
