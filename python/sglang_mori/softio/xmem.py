"""Linux cross-memory attach (process_vm_readv / process_vm_writev) through ctypes.

One system call copies between this process's memory and another process's, with no intermediate
buffer; ctypes releases the GIL for the call, so lanes copy in parallel. The kernel allows it when
this process may ptrace the other one (same uid and no Yama restriction, or CAP_SYS_PTRACE), which
`probe` checks once per connection rather than trusting a configuration.
"""

from __future__ import annotations

import ctypes
import os
import secrets


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind(libc, name: str):
    fn = getattr(libc, name, None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # CDLL (not PyDLL): the GIL is released per call
except OSError:  # pragma: no cover - no C library to load (not Linux)
    _LIBC = None
_READV = _bind(_LIBC, "process_vm_readv") if _LIBC is not None else None
_WRITEV = _bind(_LIBC, "process_vm_writev") if _LIBC is not None else None

# A random value at a known address of this process. A target that reads it back through
# cross-memory attach proves both that it may access us and that the pid it was given names this
# process (a pid from another pid namespace would name somebody else, or nobody).
_TOKEN = ctypes.c_uint64(int.from_bytes(secrets.token_bytes(8), "little"))


def available() -> bool:
    return _READV is not None and _WRITEV is not None


def identity() -> tuple[int, int, int]:
    """(pid, token address, token value) for the intra-host hello."""
    return os.getpid(), ctypes.addressof(_TOKEN), _TOKEN.value


def probe(pid: int, token_addr: int, token: int) -> str | None:
    """None when `pid` is the process that sent this token and we may read and write it;
    otherwise why not."""
    if not available():
        return "process_vm_readv/process_vm_writev are not available"
    seen = ctypes.c_uint64(0)
    try:
        copy(_READV, pid, ctypes.addressof(seen), [(token_addr, 8)])
    except OSError as exc:
        return f"cannot read the memory of pid {pid}: {exc.strerror or exc}"
    if seen.value != token:
        return f"pid {pid} is not the initiator (another pid namespace?)"
    try:
        copy(_WRITEV, pid, ctypes.addressof(seen), [(token_addr, 8)])  # same value back
    except OSError as exc:
        return f"cannot write the memory of pid {pid}: {exc.strerror or exc}"
    return None


def pull(pid: int, local_addr: int, pieces: list) -> None:
    """Copy the other process's `pieces` [(address, length)] to local_addr, back to back."""
    copy(_READV, pid, local_addr, pieces)


def push(pid: int, local_addr: int, pieces: list) -> None:
    """Copy local bytes from local_addr, back to back, into the other process's `pieces`."""
    copy(_WRITEV, pid, local_addr, pieces)


def copy(fn, pid: int, local_addr: int, pieces: list) -> None:
    """One call for the whole frame; OSError on failure.

    The kernel may copy less than asked without an error (one call moves at most about 2 GiB),
    so a short count continues from where it stopped; each round must make progress, which
    bounds the loop by the number of bytes.
    """
    total = sum(length for _, length in pieces)
    if total == 0:
        return
    done = 0
    while done < total:
        remote, skip = [], done
        for addr, length in pieces:
            if skip >= length:
                skip -= length
                continue
            remote.append((addr + skip, length - skip))
            skip = 0
        riov = (_Iovec * len(remote))(*remote)
        liov = _Iovec(local_addr + done, total - done)
        n = fn(pid, ctypes.byref(liov), 1, riov, len(remote), 0)
        if n <= 0:
            err = ctypes.get_errno() if n < 0 else 0
            raise OSError(err, os.strerror(err) if err else "no progress")
        done += n
