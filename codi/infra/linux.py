"""Linux process controls that the standard library lacks (prctl, through ctypes).

    from codi.infra.linux import set_parent_death_signal
    set_parent_death_signal(signal.SIGKILL)      # this process is killed when its parent dies

Used by the training launcher, the sandbox and the pipelines' process guard.
"""

from __future__ import annotations

import ctypes
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


class LinuxError(OSError):
    """A call the kernel refused; the message names the call."""


def checked(ret: int, what: str) -> None:
    """Raise LinuxError with errno's text if a libc call returned non-zero."""
    if ret != 0:
        err = ctypes.get_errno()
        raise LinuxError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int = 0) -> None:
    checked(libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
            f"prctl({option}, {arg})")


def set_parent_death_signal(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (a no-op off Linux)."""
    if sys.platform.startswith("linux"):
        prctl(PR_SET_PDEATHSIG, int(sig))
