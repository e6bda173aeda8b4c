"""Isolation primitives for the sandbox worker (Linux): mounts, capabilities, rlimits, the memory cgroup,
and the imports that must happen before a child loses the right to read the interpreter's files.

    from codi.tracing import limits
    limits.preload(); limits.private_mounts(tmp_mb=64)   # in the worker, in its new mount namespace
    limits.import_named_modules(program, setup)          # in the per-sample child, then
    limits.apply_rlimits(limits.rlimits(sandbox_cfg, base_vm))
    limits.drop_to_uid(60123)                 # or limits.drop_capabilities() in a user namespace

Used by codi.tracing.worker; nothing here runs untrusted code. Design: docs/design/sandbox.md, "The sandbox".
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pkgutil
import re
import resource
import signal
import sys
import time
from typing import TYPE_CHECKING

from codi.infra.linux import (
    PR_CAPBSET_DROP,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_NO_NEW_PRIVS,
    LinuxError,
    checked,
    libc,
    prctl,
)

if TYPE_CHECKING:  # the worker gets the fields as a namespace: it does not import codi.infra.config (yaml)
    from codi.schemas.extract import SandboxConfig

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit -> mount flag, to keep the flags a user namespace locks on a remount
_ST_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME,
             2048: MS_NODIRATIME, 4096: MS_RELATIME}
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


# Imported once in the worker, so that every forked child has them even after it has lost the
# right to read the interpreter's files: what MBPP/HumanEval/CRUXEval-style programs use, generously.
PRELOAD = (
    "abc argparse array ast asyncio base64 binascii bisect calendar cmath codecs collections "
    "collections.abc colorsys concurrent.futures contextlib copy copyreg csv ctypes dataclasses datetime "
    "decimal difflib dis enum errno fnmatch fractions functools gc glob graphlib hashlib heapq hmac "
    "html html.parser inspect io ipaddress itertools json keyword linecache locale math numbers "
    "operator os pathlib pickle platform pprint queue random re reprlib secrets shlex shutil signal "
    "socket statistics string struct subprocess sys tempfile textwrap threading time timeit tokenize "
    "traceback types typing unicodedata urllib.parse uuid warnings weakref zlib zoneinfo _strptime "
    "email.utils xml.etree.ElementTree"
).split()
# Stdlib modules a program may not make the child import while it is still privileged: they
# start programs, open windows or install things.
IMPORT_DENY = frozenset(
    "antigravity this webbrowser turtle turtledemo tkinter idlelib ensurepip venv pydoc pydoc_data "
    "lib2to3 msilib winreg winsound".split())


def preload() -> None:
    """Import PRELOAD and every codec module (what is missing on this platform is skipped).

    Codecs are the stdlib's lazy import with no import statement to find: `s.encode('shift_jis')`
    imports `encodings.shift_jis` on first use. A child that can no longer read the interpreter's files
    would get LookupError where the real program gets bytes, and take a different path. All of them
    cost about 0.1 s and 4 MB once per worker."""
    import encodings
    codecs = [f"encodings.{m.name}" for m in pkgutil.iter_modules(encodings.__path__)]
    for name in (*PRELOAD, *codecs):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - e.g. encodings.mbcs exists only on Windows
            pass


_QUOTED_NAME = re.compile(r"""['"]([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)['"]""")


def import_named_modules(*texts: str) -> None:
    """Import the stdlib modules the program and setup name, before losing the right to.

    A line scan, not a parse: it only has to find candidates (a wrong guess imports a harmless
    stdlib module or nothing; the program's own import statement decides what it gets). A string
    literal that is a module name counts too: `__import__('lzma')`, `importlib.import_module("bz2")`."""
    names = set()
    for text in texts:
        if "import" not in text:
            continue
        names.update(_QUOTED_NAME.findall(text))
        for line in text.split("\n"):
            words = line.replace(",", " ").replace("(", " ").split()
            if len(words) >= 2 and words[0] == "import":
                names.update(w for w in words[1:] if w != "as")
            elif len(words) >= 4 and words[0] == "from" and words[2] == "import":
                names.add(words[1])
                names.update(f"{words[1]}.{w}" for w in words[3:] if w.isidentifier())
    for name in sorted(names):
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names and top not in IMPORT_DENY and name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - `from m import function` names no module
                pass


def no_new_privs() -> None:
    """execve can never gain privileges again (setuid binaries, file capabilities)."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def child_subreaper() -> None:
    """Orphaned descendants are re-parented to us, so that they can be found, killed and reaped."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def drop_bounding_set() -> None:
    """Empty the capability bounding set: no exec'd program can ever get a capability back.

    Our own effective capabilities (needed to set up each sample) are untouched."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        prctl(PR_CAPBSET_DROP, cap)


def drop_capabilities() -> None:
    """Clear the effective, permitted and inheritable capability sets of this process."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header = Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (Data * 2)()
    checked(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset(0)")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    checked(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount({source}, {target}, {fstype})")


def private_mounts(tmp_mb: int, hide: tuple[str, ...] = ()) -> list[str]:
    """In a fresh mount namespace: a /proc of our PID namespace, / read-only, private tmpfs on
    /tmp and /dev/shm, and tmpfs over each path of `hide`. Returns what was done, in words;
    raises LinuxError when the read-only root or the private /tmp cannot be had."""
    done = []
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        done.append("own /proc")
    except LinuxError:
        pass  # without it /proc shows the host's processes, which is information, not access
    locked = 0
    for st, ms in _ST_TO_MS.items():
        if os.statvfs("/").f_flag & st:
            locked |= ms
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked, None)
    done.append("read-only /")
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    done.append(f"private {tmp_mb} MB tmpfs /tmp")
    try:
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777")
        done.append("private /dev/shm")
    except LinuxError:
        pass
    for path in hide:
        if os.path.isdir(path) and os.path.realpath(path) not in ("/", "/tmp"):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
            done.append(f"{path} hidden")
    return done


def vm_bytes() -> int:
    """This process's virtual memory size (what RLIMIT_AS counts)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _within_hard(which: int, soft: int, hard: int) -> tuple[int, int]:
    """(soft, hard) lowered to the current hard limit, which nobody here may raise."""
    cur_hard = resource.getrlimit(which)[1]
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    return soft, hard


def rlimits(cfg: SandboxConfig, base_vm: int) -> list[tuple[int, tuple[int, int]]]:
    """The per-sample limits, computed once in the worker; apply_rlimits sets them in each child.

    RLIMIT_AS allows `memory_mb` on top of `base_vm`, the forked worker's footprint (a limit on the
    total would depend on how much the worker happens to have imported)."""
    mb = 1 << 20
    wanted = [
        (resource.RLIMIT_CPU, cfg.cpu_time_s, cfg.cpu_time_s + 1),  # SIGXCPU, then SIGKILL
        (resource.RLIMIT_AS, base_vm + cfg.memory_mb * mb, base_vm + cfg.memory_mb * mb),
        (resource.RLIMIT_FSIZE, cfg.max_file_mb * mb, cfg.max_file_mb * mb),
        (resource.RLIMIT_NPROC, cfg.max_processes, cfg.max_processes),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NOFILE, 256, 256),
    ]
    return [(which, _within_hard(which, soft, hard)) for which, soft, hard in wanted]


def apply_rlimits(limits: list[tuple[int, tuple[int, int]]]) -> None:
    for which, pair in limits:
        resource.setrlimit(which, pair)


# ------------------------------------------------------------------- memory cgroup (v1, as root)
# RLIMIT_AS bounds one process; a sample of max_processes processes could hold that many times
# memory_mb. A cgroup bounds them all together (and the tmpfs pages they write). Only the cgroup
# v1 memory controller is handled (what our machines have); elsewhere the pool goes without.
_CGROUP_V1 = "/sys/fs/cgroup/memory"


def memory_cgroup(name: str, limit_bytes: int) -> str | None:
    """Create the memory cgroup `name` under our own (so the container's limit still holds),
    limited to `limit_bytes` of memory (and swap). Its path, or None where that is not possible."""
    try:
        with open("/proc/self/cgroup") as f:
            own = next(line.rstrip("\n").split(":", 2)[2] for line in f
                       if "memory" in line.split(":", 2)[1].split(","))
    except (OSError, StopIteration, IndexError):
        return None
    parent = f"{_CGROUP_V1}{own.rstrip('/')}"
    _remove_stale_cgroups(parent)
    path = f"{parent}/{name}"
    try:
        os.mkdir(path)
    except OSError:
        return None
    try:
        for knob in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            if os.path.exists(f"{path}/{knob}"):
                with open(f"{path}/{knob}", "w") as f:
                    f.write(str(limit_bytes))
    except OSError:
        remove_cgroup(path)
        return None
    return path


def _remove_stale_cgroups(parent: str) -> None:
    """Remove `codi-sandbox-<pid>-*` cgroups left by a pool whose process was killed."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) == 4 and parts[:2] == ["codi", "sandbox"] and parts[2].isdigit():
            if not os.path.exists(f"/proc/{parts[2]}"):
                try:
                    os.rmdir(f"{parent}/{name}")  # fails (and stays) while processes are in it
                except OSError:
                    pass


def join_cgroup(path: str) -> None:
    """Move this process (and so all it will start) into the cgroup."""
    with open(f"{path}/cgroup.procs", "w") as f:
        f.write("0")


def oom_kills(path: str) -> int:
    """How many processes the cgroup's OOM killer has killed so far."""
    try:
        with open(f"{path}/memory.oom_control") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def remove_cgroup(path: str) -> None:
    for _ in range(50):  # its last processes may still be exiting
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def drop_to_uid(uid: int) -> None:
    """Become `uid`/`uid` with no supplementary groups; from root this clears every capability."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a helper drops to it and calls kill(-1), which reaches
    exactly the processes that uid may signal (its own), wherever they are (even after setsid)."""
    pid = os.fork()
    if pid == 0:
        try:
            drop_to_uid(uid)
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # none left
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (a scan of /proc: this kernel has no .../children)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(name))
    return out
