"""What the scheduler reports about itself: typed records, stored column-wise.

Twin of ``vllm/v1/metrics/stats.py`` (0.33.0), reduced to what a block
allocation simulator observes: ``SchedulerStats`` (one per step, made by
``Scheduler.make_stats`` after the step's output is applied, as vLLM's
scheduler makes its own), with the scheduler's gauges (``SchedulerGauges``,
vLLM's ``num_running_reqs``/``num_waiting_reqs``/``kv_cache_usage`` plus the
pool's free and fenced blocks), ``PrefixCacheStats`` and
``SpecDecodingStats``. Field names are the frame columns of the metric
registry (``sim.metrics``), so a record flattens straight into a row.

``Columns`` stores records as one list per column, in registry order, and
refuses a record whose fields differ from its columns: a field added here
but not registered (or the other way round) fails at the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from operator import attrgetter
from typing import TYPE_CHECKING, Any, get_type_hints

if TYPE_CHECKING:
    pass


# The step records are built for every step and read at once: not frozen
# (a frozen dataclass sets each field through ``object.__setattr__``, three
# times the cost); nothing keeps or changes one.
@dataclass(kw_only=True, slots=True)
class SchedulerGauges:
    """The scheduler's levels at one instant (the step record and the
    samples both take them from ``Scheduler.make_gauges``)."""

    num_requests_running: int
    num_requests_waiting: int
    num_free_blocks: int
    num_deferred_blocks: int
    kv_cache_usage_perc: float
    num_retained_checkpoints: int


@dataclass(kw_only=True, slots=True)
class PrefixCacheStats:
    """vLLM's ``PrefixCacheStats`` of one step (fresh and preempted lookups
    together, in tokens) and the cached blocks the step evicted."""

    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    prefix_cache_evicted_blocks: int


@dataclass(kw_only=True, slots=True)
class SpecDecodingStats:
    """vLLM's ``SpecDecodingStats`` of one step (MTP drafts)."""

    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass(kw_only=True, slots=True)
class SchedulerStats:
    """One step, as the scheduler saw it once the step's output was applied."""

    step: int
    num_scheduled_requests: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_admitted: int
    num_resumed: int
    num_preemptions: int
    num_finished: int
    num_generation_tokens: int
    gauges: SchedulerGauges
    prefix_cache_stats: PrefixCacheStats
    spec_decoding_stats: SpecDecodingStats


def flat_columns(record: Any) -> dict[str, Any]:
    """A record's leaf fields by name, nested records flattened.

    >>> flat_columns(SpecDecodingStats(num_draft_tokens=3, num_accepted_tokens=2))
    {'num_draft_tokens': 3, 'num_accepted_tokens': 2}
    """
    return dict(zip(*flat_row(record), strict=True))


def flat_row(record: Any) -> tuple[tuple[str, ...], tuple]:
    """A record's leaf names (one tuple per record type: the same object
    every time) and its leaf values in that order."""
    names, read = _flattener(type(record))
    return names, read(record)


@cache
def _flattener(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple]]:
    """A record type's leaf names and one getter reading them all (dotted
    paths through nested records): built once per type, as a step's stats
    are flattened at every step. A field is nested when its declared type is
    a record."""
    paths = _leaf_paths(cls, "")
    getter = attrgetter(*paths)
    read = getter if len(paths) > 1 else lambda record: (getter(record),)
    return tuple(path.rpartition(".")[2] for path in paths), read


def _leaf_paths(cls: type, prefix: str) -> list[str]:
    if not is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a record")
    hints = get_type_hints(cls)
    paths: list[str] = []
    for name in (spec.name for spec in fields(cls)):
        declared = hints[name]
        if is_dataclass(declared):
            paths.extend(_leaf_paths(declared, f"{prefix}{name}."))
        else:
            paths.append(prefix + name)
    return paths


class Columns:
    """Rows of one shape, one list per column, columns in a fixed order."""

    def __init__(self, names: Sequence[str]) -> None:
        self._columns: dict[str, list[Any]] = {name: [] for name in names}
        # The last row shape appended and its columns in that order: a
        # record's rows share one names tuple, checked once.
        self._last_names: tuple[str, ...] | None = None
        self._last_targets: list[list[Any]] = []

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._columns)

    def append(self, row: Mapping[str, Any]) -> None:
        self.append_values(tuple(row), tuple(row.values()))

    def append_values(self, names: tuple[str, ...], values: Sequence[Any]) -> None:
        """A row as its column names and its values in the same order."""
        if names is not self._last_names:
            self._last_targets = self._targets(names)
            self._last_names = names
        if len(values) != len(names):  # checked first: a ragged row would be half appended
            raise ValueError(f"row of {len(values)} values for {len(names)} columns")
        # Each value onto its column without a Python step per column (a
        # row per step): ``list.append`` returns None, so ``any`` runs the map through.
        any(map(list.append, self._last_targets, values))

    def _targets(self, names: tuple[str, ...]) -> list[list[Any]]:
        if len(set(names)) != len(names) or set(names) != self._columns.keys():
            extra = sorted(set(names) - set(self._columns))
            missing = sorted(set(self._columns) - set(names))
            raise KeyError(f"row does not match the columns: unregistered {extra}, missing {missing}")
        return [self._columns[name] for name in names]

    def __len__(self) -> int:
        return len(next(iter(self._columns.values()), []))

    def to_dict(self) -> dict[str, list[Any]]:
        """The columns in order (the lists themselves: read, do not change)."""
        return self._columns
