"""`python -S -E -s _die_with_parent.py PARENT_PID COMMAND...`: become COMMAND, set to get SIGTERM
when the thread that started this process dies, even by SIGKILL (Linux PR_SET_PDEATHSIG).

Why a separate interpreter rather than subprocess's preexec_fn: preexec_fn runs Python between
fork and exec in a copy of the caller's multithreaded process (torch, JAX: a lock another thread
held at the fork can deadlock it, and JAX warns on every such fork); this interpreter is
single-threaded and costs ~20 ms a build. It imports nothing of the package (run by path)."""
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main() -> None:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the parent died before prctl took effect
            sys.exit(128 + signal.SIGTERM)
    os.execv(cmd[0], cmd)


main()
