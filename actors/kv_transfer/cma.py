"""Cross-memory attach: bytes copied straight from another process's memory into this one's
(Linux ``process_vm_readv``, the transport MPI and UCX use between processes of one machine).
One copy, from the producer's KV cache into the consumer's, with no segment or socket between.

The kernel allows it when this process may trace the other (same user, and neither Yama's
``ptrace_scope`` nor a seccomp profile forbidding it); otherwise ``read_regions`` raises
PermissionError and the caller takes another path."""
from __future__ import annotations

import ctypes
import errno
import os
import sys

IOV_MAX = 1024                       # iovecs per call (Linux's UIO_MAXIOV)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _syscall():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "process_vm_readv", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec),
                   ctypes.c_ulong, ctypes.c_ulong]
    return fn


_process_vm_readv = _syscall()


def available() -> bool:
    return _process_vm_readv is not None


def read_regions(pid: int, copies: list[tuple[int, int, int]]) -> int:
    """Copy each (local address, remote address, bytes) from process ``pid``; returns the bytes
    copied. PermissionError when the system forbids reading that process, ProcessLookupError
    when it is gone, OSError for the rest (a short read included)."""
    if _process_vm_readv is None:
        raise PermissionError(errno.ENOSYS, "process_vm_readv is not available on this system")
    total = 0
    for start in range(0, len(copies), IOV_MAX):
        batch = copies[start:start + IOV_MAX]
        local = (_IOVec * len(batch))(*[(dst, n) for dst, _, n in batch])
        remote = (_IOVec * len(batch))(*[(src, n) for _, src, n in batch])
        want = sum(n for _, _, n in batch)
        got = _process_vm_readv(pid, local, len(batch), remote, len(batch), 0)
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                raise PermissionError(err, f"reading process {pid}'s memory: {os.strerror(err)}")
            if err == errno.ESRCH:
                raise ProcessLookupError(err, f"process {pid} is gone")
            raise OSError(err, f"reading process {pid}'s memory: {os.strerror(err)}")
        if got != want:
            raise OSError(errno.EIO, f"read {got} of {want} bytes from process {pid}")
        total += got
    return total
