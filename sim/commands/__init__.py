"""One module per ``kvsim`` command (the shape of ``vllm/entrypoints/cli/``).

Each module defines ``register(subparsers)``, which adds its sub-parser and
sets ``func`` to the command's entry point. Commands are the only place that
prints or writes result files; ``sim.analysis`` returns frames and reports.
A new command is a new module here plus one line in ``COMMAND_MODULES``.
"""

# The order is the order of ``kvsim --help``.
COMMAND_MODULES: tuple[str, ...] = (
    "layout",
    "run",
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
)
