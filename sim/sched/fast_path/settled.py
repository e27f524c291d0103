"""Settled decode steps (rules 1-2): a decode's ``allocate_slots`` and
``cache_blocks`` read its positions only through block arithmetic, so after a
real call, the next ones whose positions, widened by the margin, lie strictly
inside the same block of every size change nothing."""

from __future__ import annotations


class SettledSteps:
    """Per request, the window of its last real call of one kind.
    ``prompt_unit``: a size that bounds windows only where they reach into
    the prompt (the hash unit)."""

    def __init__(
        self, block_sizes: tuple[int, ...], margin_tokens: int, prompt_unit: int | None = None
    ) -> None:
        if not block_sizes or min(block_sizes) <= 0 or (prompt_unit is not None and prompt_unit <= 0):
            raise ValueError(f"block sizes must be positive, got {block_sizes} and unit {prompt_unit}")
        self.block_sizes = tuple(sorted(set(block_sizes)))
        self.margin_tokens = margin_tokens
        self._with_unit = (
            self.block_sizes if prompt_unit is None else tuple(sorted({*block_sizes, prompt_unit}))
        )
        # request id -> the least first and greatest last token of a settled call
        self._bounds: dict[str, tuple[int, int]] = {}

    def window(
        self, first_token: int, last_token: int, prompt_tokens: int | None = None
    ) -> tuple[int, ...] | None:
        """The block per size holding the widened span; None where it touches or crosses a
        boundary (below 0 crosses 0's). ``prompt_tokens`` None: it reaches into the prompt."""
        blocks = self._blocks(first_token, last_token, prompt_tokens)
        return None if blocks is None else tuple(index for index, _ in blocks)

    def _past_prompt(self, first_token: int, prompt_tokens: int | None) -> bool:
        return prompt_tokens is not None and first_token - self.margin_tokens > prompt_tokens

    def _blocks(
        self, first_token: int, last_token: int, prompt_tokens: int | None
    ) -> list[tuple[int, int]] | None:  # ``window``'s (index, size) pairs
        low = first_token - self.margin_tokens
        high = last_token + self.margin_tokens
        sizes = self.block_sizes if self._past_prompt(first_token, prompt_tokens) else self._with_unit
        blocks = []
        for size in sizes:
            index = low // size
            if low % size == 0 or high // size != index:
                return None
            blocks.append((index, size))
        return blocks

    def is_settled(self, request_id: str, first_token: int, last_token: int) -> bool:
        bounds = self._bounds.get(request_id)
        return bounds is not None and bounds[0] <= first_token and last_token <= bounds[1]

    def bounds(self, request_id: str) -> tuple[int, int] | None:  # None: the next call is real
        return self._bounds.get(request_id)

    def record(
        self, request_id: str, first_token: int, last_token: int, prompt_tokens: int | None = None
    ) -> None:
        """A real call was made over these tokens."""
        blocks = self._blocks(first_token, last_token, prompt_tokens)
        if blocks is None:
            self._bounds.pop(request_id, None)
            return
        # Block k of size b holds positions k*b + 1 .. (k+1)*b - 1 strictly
        # inside; the margin must fit within them on both sides.
        least = max(k * b + 1 + self.margin_tokens for k, b in blocks)
        if self._past_prompt(first_token, prompt_tokens):
            # A settled call must lie past the prompt too, or the unit counts.
            least = max(least, prompt_tokens + 1 + self.margin_tokens)  # type: ignore[operator]
        self._bounds[request_id] = (least, min((k + 1) * b - 1 - self.margin_tokens for k, b in blocks))

    def forget(self, request_id: str) -> None:  # its blocks were freed
        self._bounds.pop(request_id, None)
