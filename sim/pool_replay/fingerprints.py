"""The fingerprint the pool replay writes into a cell: who wrote it, where.

No twin in vLLM (the worker writes real keys and values).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Fingerprint of a cell: one int64, tiled over the cell's bytes.
#   bits 56..62: group + 1, 48..55: layer label + 1 (layer index in the group
#   * 4 + state index), 24..47: request number, 0..23: position.
POSITION_BITS = 24
REQUEST_BITS = 24
MAX_LABEL = 254
POSITION_MASK = (1 << POSITION_BITS) - 1
# Shadow code 0: nobody wrote this cell (not verified). A cell zeroed for a
# request carries that request and this position; its bytes are zeros.
UNKNOWN = 0
ZERO_POSITION = POSITION_MASK
# Words per gather or scatter (int64 indices: 128 MiB), to bound the memory
# a full pool's Mamba pages (~1.6 MB each) and a final check need.
CHUNK_WORDS = 1 << 24


class PoolCorruption(AssertionError):
    """The bytes of the pool do not follow the block tables."""


def fingerprint(request_number: int | np.ndarray, position: int | np.ndarray) -> Any:
    return (np.int64(request_number) << POSITION_BITS) | np.int64(position)


def describe_word(word: int, request_names: dict[int, str]) -> str:
    """What one 8-byte word found in the pool says about its writer."""
    if word == 0:
        return "zeros"
    group, label = (word >> 56) - 1, ((word >> 48) & 0xFF) - 1
    number = (word >> POSITION_BITS) & ((1 << REQUEST_BITS) - 1)
    position = word & POSITION_MASK
    if group < 0 or label < 0 or number not in request_names:
        return f"bytes that are no fingerprint (0x{word & 0xFFFFFFFFFFFFFFFF:016x})"
    return (
        f"request {request_names[number]}'s fingerprint "
        f"(group {group}, layer label {label}, position {position})"
    )
