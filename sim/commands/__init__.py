"""One module per ``kvsim`` command (the shape of ``vllm/entrypoints/cli/``).

Each module defines ``register(subparsers)``, which adds its sub-parser and
sets ``func`` (``cmd_<name>``) to the command's entry point, and returns
None. Commands print; result files are written through ``sim.results`` by the
commands and by the analysis runs that persist as they go (``sim.analysis``:
a sweep's runs, a capacity search, a gate report, the plots).
A new command is a new module here plus one line in ``COMMAND_MODULES``.
"""

# The order is the order of ``kvsim --help``.
COMMAND_MODULES: tuple[str, ...] = (
    "pool_plan",
    "run",
    "capacity",
    "plot",
    "gate",
    "sweep",
    "bench",
    "conform",
    "serve",
    "replay",
    "export_trace",
    "validate",
    "calibrate",
    "published",
    "replay_pool",
    "patches",
)
