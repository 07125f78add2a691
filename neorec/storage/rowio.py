"""Record I/O for file-backed row stores: gather/scatter fixed-size records with pread/pwrite.

One call reads (or writes) ``n`` records at file offsets ``base + ids[i] * rec_bytes``. Runs of
consecutive ids become one system call, and blocks of ids are spread over ``threads`` OpenMP
threads (an SSD serves several requests in flight faster than one at a time). The loop is a tiny C
function compiled on first use (like the cpu TBE kernel) because a Python loop of ``os.pread``
costs a few microseconds per record; without a C compiler the same loop runs in Python.

The C source lives in this file (not in a separate ``.c``) so that it ships with the package.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from neorec.ops import settings

__all__ = ["read_records", "write_records", "native_available"]

_SOURCE = r"""
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

#define BLOCK 256

/* One contiguous transfer, retried on EINTR and continued after a short count.
   Returns 0, -errno, or -1000000 for an unexpected end of file (short read). */
static int64_t xfer(int fd, char *buf, int64_t len, int64_t off, int is_write) {
    while (len > 0) {
        ssize_t r = is_write ? pwrite(fd, buf, (size_t)len, (off_t)off)
                             : pread(fd, buf, (size_t)len, (off_t)off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (r == 0) return is_write ? -(int64_t)EIO : -1000000;
        buf += r; off += r; len -= r;
    }
    return 0;
}

/* Record i lives at base + ids[i] * rec and maps to buf + i * rec. Returns 0 or the first error;
   *bad receives the index of the record that failed. */
int64_t rowio(int fd, const int64_t *ids, int64_t n, int64_t rec, int64_t base, char *buf,
              int threads, int is_write, int64_t *bad) {
    int64_t err = 0;
    *bad = -1;
    int64_t nblocks = (n + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t i = b * BLOCK, end = i + BLOCK < n ? i + BLOCK : n;
        while (i < end) {
            int64_t j = i + 1;
            while (j < end && ids[j] == ids[j - 1] + 1) j++;
            int64_t rc = xfer(fd, buf + i * rec, (j - i) * rec, base + ids[i] * rec, is_write);
            if (rc != 0) {
                #pragma omp critical
                { if (err == 0) { err = rc; *bad = i; } }
                break;
            }
            i = j;
        }
    }
    return err;
}
"""
_FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC")
_EOF = -1_000_000
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False


def _cache_dir() -> Path:
    from neorec.ops.cpu import cache_dir

    return cache_dir()


def _load() -> ctypes.CDLL | None:
    """The compiled helper, or None when no C compiler is available (then Python does the loop)."""
    global _LIB, _TRIED
    with _LOCK:
        if _TRIED:
            return _LIB
        _TRIED = True
        cc = shutil.which(os.environ.get("CC", "cc"))
        if cc is None:
            return None
        key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), cc]).encode()).hexdigest()[:20]
        so = _cache_dir() / f"rowio-{key}.so"
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="neorec-rowio-") as tmpd:
                src = Path(tmpd) / "rowio.c"
                src.write_text(_SOURCE)
                tmp_so = Path(tmpd) / "rowio.so"
                proc = subprocess.run(
                    [cc, *_FLAGS, str(src), "-o", str(tmp_so)], capture_output=True, check=False
                )
                if proc.returncode != 0:
                    return None
                # Atomic publish: a concurrent builder renames its own complete copy.
                staged = so.with_suffix(f".{os.getpid()}.tmp")
                shutil.copyfile(tmp_so, staged)
                os.replace(staged, so)
        lib = ctypes.CDLL(str(so))
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rowio.argtypes = [ctypes.c_int, vp, i64, i64, i64, vp, ctypes.c_int, ctypes.c_int, vp]
        lib.rowio.restype = i64
        _LIB = lib
        return lib


def native_available() -> bool:
    """Whether the compiled helper is in use (else the Python fallback)."""
    return _load() is not None


def _python_io(fd: int, ids: Tensor, rec: int, base: int, buf: Tensor, is_write: bool) -> None:
    view = memoryview(buf.numpy().data).cast("B")
    for i, r in enumerate(ids.tolist()):
        lo = i * rec
        off = base + r * rec
        done = 0
        while done < rec:
            if is_write:
                n = os.pwrite(fd, view[lo + done : lo + rec], off + done)
            else:
                n = os.preadv(fd, [view[lo + done : lo + rec]], off + done)
            if n == 0:
                raise EOFError(f"record {r}: end of file at byte {off + done}")
            done += n


def _run(fd: int, ids: Tensor, rec: int, base: int, buf: Tensor, threads: int, write: bool) -> None:
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() == 0:
        return
    lib = _load()
    if lib is None or not settings.NATIVE:
        _python_io(fd, ids, rec, base, buf, write)
        return
    bad = ctypes.c_int64(-1)
    # ctypes drops the GIL for the call: a prefetch thread reads while the main thread computes.
    rc = lib.rowio(
        fd,
        ids.data_ptr(),
        ids.numel(),
        rec,
        base,
        buf.data_ptr(),
        threads,
        int(write),
        ctypes.byref(bad),
    )
    if rc == _EOF:
        raise EOFError(f"record {int(ids[bad.value])}: unexpected end of file")
    if rc != 0:
        raise OSError(-rc, f"{os.strerror(-rc)} (record {int(ids[bad.value])})")


def read_records(
    fd: int, ids: Tensor, rec_bytes: int, base: int, out: Tensor, threads: int
) -> None:
    """Read record ``ids[i]`` into row ``i`` of ``out`` (contiguous, ``rec_bytes`` per row)."""
    _run(fd, ids, rec_bytes, base, out, threads, write=False)


def write_records(
    fd: int, ids: Tensor, rec_bytes: int, base: int, records: Tensor, threads: int
) -> None:
    """Write row ``i`` of ``records`` to record ``ids[i]``; raises OSError (e.g. ENOSPC)."""
    _run(fd, ids, rec_bytes, base, records.contiguous(), threads, write=True)
