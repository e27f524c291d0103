"""The traces kvsim ships in ``sim/data`` (provenance in ``sim/data/README.md``).

Paths are resolved from this file, not from the current directory, so a
scenario runs the same from any working directory and from an installed
package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

TraceFormat = Literal["mooncake", "azure", "sharegpt", "synthetic", "sessions", "timed_trace", "timed_csv"]

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

# First 15 minutes (2,728 requests) of the Mooncake FAST'25 conversation trace.
DEFAULT_TRACE = DATA_DIR / "mooncake_conversation_slice.jsonl"
# First 5 minutes (781 requests) of the Azure 2023 code trace: a silent gap,
# then a burst; no prefix information (the no-sharing control).
AZURE_CODE_SLICE = DATA_DIR / "azure_code_slice.csv"
# First 2,000 requests (about 7 minutes) of the Azure 2023 conversation trace:
# short chat prompts; sped up, it saturates decode (the speed benchmark).
AZURE_CONV_SLICE = DATA_DIR / "azure_conv_slice.csv"
# ShareGPT prompt/output lengths (Llama-2 tokenizer), no arrival times.
SHAREGPT_LENGTHS = DATA_DIR / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"

# Names a scenario may give as ``workload.trace`` instead of a path.
SHIPPED_TRACES: dict[str, tuple[Path, TraceFormat]] = {
    "default": (DEFAULT_TRACE, "mooncake"),
    "mooncake-slice": (DEFAULT_TRACE, "mooncake"),
    "azure-code-slice": (AZURE_CODE_SLICE, "azure"),
    "azure-conv-slice": (AZURE_CONV_SLICE, "azure"),
    "sharegpt-lengths": (SHAREGPT_LENGTHS, "sharegpt"),
}


def display_path(path: Path) -> str:
    """``sim/data/<file>`` for shipped files (stable across machines), else as given."""
    resolved = path.resolve()
    if resolved.parent == DATA_DIR:
        return f"sim/data/{resolved.name}"
    return str(path)
