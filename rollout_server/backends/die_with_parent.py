"""`python die_with_parent.py PARENT_PID COMMAND...`: asks Linux to send SIGTERM to
this process when its parent dies (even by SIGKILL), then becomes COMMAND (the
setting survives exec), so an engine never outlives the trainer or server that
started it.

A separate program rather than a `preexec_fn`: that would run Python in a forked
copy of a gRPC-, JAX- and torch-threaded process, and such children crash now
and then (a segfault in the child before exec was seen on a rollout host). Kept
free of imports from the project: it runs as a plain script.
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main() -> None:
    parent, command = int(sys.argv[1]), sys.argv[2:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took: nobody to outlive
            sys.exit(f"die_with_parent: parent {parent} is gone; not starting {command[0]}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
