"""`legorl train` with one phase of one step stalled, for the stop-while-busy test
(`test_train_stop.py`): `python stalling_train.py PHASE STEP LEGORL_ARGS...`.

PHASE `publish`: publishing version STEP writes the whole version into its staging
directory, then stalls before installing it. PHASE `update`: step STEP's update
runs, then stalls before returning. Either way the stall is in the worker thread
the loop waits on, and the line `stalled: PHASE STEP` on stderr says it began.
A test instrument: the command itself has no such hook.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

# The checkout this file is in, not whatever `legorl_jax` the interpreter finds first.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from legorl_jax.core.allocator import keep_freed_memory  # noqa: E402

STALL_S = 3600.0


def stall(phase: str, step: int) -> None:
    print(f"stalled: {phase} {step}", file=sys.stderr, flush=True)
    time.sleep(STALL_S)


def main() -> int:
    keep_freed_memory()  # first, as `legorl` does
    phase, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

    from legorl_jax import cli
    from legorl_jax.train.publish import DirectoryPublisher
    from legorl_jax.train.step import Learner

    if phase == "publish":
        write = DirectoryPublisher._write

        def stalling_write(self: DirectoryPublisher, model: Any, version: int, *args: Any) -> Any:
            written = write(self, model, version, *args)
            if version == at:
                stall(phase, version)
            return written

        DirectoryPublisher._write = stalling_write  # type: ignore[method-assign]
    elif phase == "update":
        update = Learner.update

        def stalling_update(self: Learner, *args: Any, **kwargs: Any) -> Any:
            result = update(self, *args, **kwargs)
            if self.step == at:
                stall(phase, self.step)
            return result

        Learner.update = stalling_update  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown phase {phase!r}: publish or update")
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
