"""The cache's inter-process lock: filelock (fcntl on Linux, so a dead holder frees it at once),
with a timeout and a message that names the lock file. This module only adds the timeout policy
and the message; the locking itself is filelock's."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import filelock

from .errors import LockTimeoutError

# A CUDA module can take minutes to build, and every other process wanting it waits for that build.
DEFAULT_TIMEOUT_S = 1800.0


def lock_timeout() -> float:
    env = os.environ.get("FLASHKDA_EXT_LOCK_TIMEOUT")
    if not env:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"FLASHKDA_EXT_LOCK_TIMEOUT={env!r} is not a number of seconds") from None
    if not value > 0:  # also nan, which filelock would wait on forever
        raise ValueError(f"FLASHKDA_EXT_LOCK_TIMEOUT={env!r} must be a positive number of seconds")
    return value


@contextlib.contextmanager
def file_lock(path: Path, timeout: Optional[float] = None, what: str = "the JIT cache"):
    """Hold the exclusive lock at path (created if missing); LockTimeoutError after timeout s."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wait = lock_timeout() if timeout is None else timeout
    lock = filelock.FileLock(str(path), timeout=wait)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise LockTimeoutError(
            f"flashkda_ext: waited {wait:g} s for the lock {path} ({what}); another live process "
            f"holds it (a dead one frees it at once). Find it with `fuser {path}`, wait for it, or "
            f"raise FLASHKDA_EXT_LOCK_TIMEOUT") from None
    try:
        yield
    finally:
        lock.release()


def try_lock(path: Path):
    """A held filelock.FileLock if the lock at path is free right now, else None (no waiting)."""
    lock = filelock.FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        return None
    return lock
