"""`InputError`: what the user fixes, so `legorl` prints its message alone (exit 1), not a traceback."""


class InputError(Exception):
    """A model directory, task, config of a model or checkpoint, or engine that cannot be used or started;
    the message says which and why. Each error class keeps its own builtin base as well (ValueError,
    RuntimeError), which is what callers catch."""
