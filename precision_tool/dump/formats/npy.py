"""The .npy tensor file, as every format of the workspace stores its tensors: read never
unpickling (allow_pickle=False by construction: a header that is not a plain numeric array is
refused), its sizes checked before anything is allocated, a large file memory-mapped. Its
failures are one-line WorkspaceErrors naming the file."""
from __future__ import annotations

import errno
import functools
import io
import math
import os
import re
from typing import Optional

import ml_dtypes
import numpy as np

from ...errors import WorkspaceError
from ...fileio import READ_FLAGS, check_regular, open_regular

MMAP_BYTES = 64 * 2 ** 20      # a tensor file larger than this is mapped, not read
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Confined:
    """An opener for read_tensor_file that refuses a path resolving outside its roots (an
    index naming ../../etc/passwd, a link out of the workspace): the roots are resolved once,
    and `root()` gives a late one (a results directory resolved when first needed). Each
    directory is resolved once (a compare opens thousands of files in a few); the file is
    opened without following a link (no lstat per file), and one that is a link is resolved
    and checked before it is opened."""

    def __init__(self, root: str, late=None, more=None):
        self.root = root
        self._real_root = os.path.realpath(root)
        self._late, self._real_late = late, None
        self._real_dirs = {}
        # more(): other roots files may be read from (the dumps the workspace's runs refer
        # to), asked on the first path outside root
        self._more_of, self._more = more, None

    def __call__(self, path: str) -> int:
        # string operations, not os.path's: a compare opens thousands of files
        directory, _, name = (path if path.startswith(os.sep) else os.path.abspath(path)).rpartition(os.sep)
        real_dir = self._real_dirs.get(directory)
        if real_dir is None:
            real_dir = self._real_dirs[directory] = os.path.realpath(directory or os.sep)
        real = real_dir + name if real_dir.endswith(os.sep) else real_dir + os.sep + name
        if _NOFOLLOW:
            self._check(path, real)
            try:
                return os.open(real, READ_FLAGS | _NOFOLLOW)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
        real = os.path.realpath(real)
        self._check(path, real)
        return os.open(real, READ_FLAGS)

    def _check(self, path: str, real: str) -> None:
        if real.startswith(self._real_root + os.sep):
            return
        if self._more is None:
            self._more = [os.path.realpath(r) for r in self._more_of()] if self._more_of else []
        if any(real.startswith(more + os.sep) for more in self._more):
            return
        if self._late is not None and self._real_late is None:
            self._real_late = os.path.realpath(self._late())
        if self._real_late is None or not real.startswith(self._real_late + os.sep):
            raise WorkspaceError(f"{path} is outside the workspace {self.root}")


def read_tensor_file(path: str, opener=None, mmap_over: Optional[int] = None) -> np.ndarray:
    """An .npy file read as read_npy reads it (allow_pickle=False, sizes checked, a large one
    memory-mapped), or a .pt as torchfile.read_pt does (nothing its pickle names is run),
    its failures as one-line WorkspaceErrors. opener(path) -> descriptor:
    the workspace passes one that refuses paths outside it; a path the user typed
    (pt, cp, dc) is opened as it is."""
    try:
        fd = opener(path) if opener else os.open(path, READ_FLAGS)
        try:
            # a large tensor is memory-mapped: compares stream it block by block
            over = MMAP_BYTES if mmap_over is None else mmap_over
            if path.endswith(".pt"):         # torch.save's archive (msprobe's dumps)
                from .torchfile import read_pt
                return read_pt(fd, over)
            return read_npy(fd, mmap_over=over)
        finally:
            os.close(fd)
    except WorkspaceError:           # outside the workspace: said as it is
        raise
    except FileNotFoundError:
        raise WorkspaceError(f"tensor file {path} is missing") from None
    except IsADirectoryError:
        raise WorkspaceError(f"{path} is a directory, not a tensor file") from None
    except ValueError as e:          # its message says what the file is (read_npy)
        raise WorkspaceError(f"tensor file {path} {e}") from None
    except EOFError:
        raise WorkspaceError(f"tensor file {path} is corrupt: empty or cut off") from None
    except OSError as e:
        raise WorkspaceError(f"tensor file {path} is unreadable: {e}") from None


_HEADER_BYTES = 1 << 16        # more than numpy's parser accepts in a header
_NPY_HEADER = re.compile(r"\{'descr': '([<>|=]?[a-zA-Z]\d*)', 'fortran_order': (True|False), "
                         r"'shape': \(((?:\d+, ?)*\d*)\), \}\s*$")


def _npy_header(f):
    """(shape, fortran_order, dtype) from an open .npy positioned at its start. The header
    numpy writes is parsed by a strict pattern (no literal_eval per file: a compare opens
    thousands); any other goes to numpy's parser. Whatever a corrupt header makes either of
    them raise becomes a ValueError."""
    try:
        magic = f.read(8)
        if len(magic) == 8 and magic[:6] == b"\x93NUMPY" and magic[6] in (1, 2, 3):
            width = 2 if magic[6] == 1 else 4
            length = int.from_bytes(f.read(width), "little")
            text = f.read(length)
            # a header cut short (its newline, say) is numpy's parser's to refuse
            m = _NPY_HEADER.match(text.decode("latin1")) if len(text) == length else None
            if m is not None:
                shape = tuple(int(d) for d in m.group(3).replace(" ", "").split(",") if d)
                return shape, m.group(2) == "True", np.dtype(m.group(1))
        f.seek(0)
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        return read(f)
    except MemoryError:
        raise
    except Exception as e:        # SyntaxError, TokenError, TypeError... from a corrupt header
        raise ValueError(f"is corrupt: not an .npy file, or its header is broken "
                         f"({type(e).__name__}: {e})") from None


_FIRST_READ = 1 << 16       # a small tensor's whole file comes in this one read


def read_npy(fd: int, mmap_over: float = math.inf) -> np.ndarray:
    """The .npy file open on fd, never unpickling: a header that is not a plain numeric array
    (objects, records) is refused, and the data length must be what the header claims,
    checked before anything is allocated (a header may claim terabytes). A file larger than
    mmap_over bytes is mapped read-only; a smaller one is read whole, header and data. A file
    under _FIRST_READ bytes takes one read and no fstat (only one that seems cut off is
    measured, and the rest read, if any): a compare reads thousands of small files, and a
    system call is most of the cost of each."""
    head = b""
    if mmap_over >= _FIRST_READ:
        head = os.read(fd, _FIRST_READ)
        if len(head) < _FIRST_READ:
            try:
                return _array_of(bytearray(head), head)    # writable, as a larger file's
            except ValueError:       # or a signal cut the read short: the size decides
                pass
    try:
        size = check_regular(fd, "").st_size
    except IsADirectoryError:
        raise
    except OSError as e:             # a named pipe, a socket, a device: said as the file's
        raise ValueError(f"is {e.strerror}") from None
    if size > mmap_over:             # its header parsed and checked as a small file's
        dtype, count, offset, shape, order = _layout(_header_of(os.pread(fd, _HEADER_BYTES, 0)),
                                                     size)
        if not count:
            return np.zeros(shape, dtype)            # no data: an empty array
        with os.fdopen(os.dup(fd), "rb") as f:
            return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)
    if len(head) > size:
        raise ValueError("is corrupt: it changed while it was read")
    raw = np.empty(size, np.uint8)               # writable, and not zeroed only to be overwritten
    got, view = len(head), memoryview(raw)
    view[:got] = head
    while got < size:                            # one call but for a signal's short read
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise ValueError("is corrupt: it changed while it was read")
        got += n
    return _array_of(raw)


def _array_of(raw, head: Optional[bytes] = None) -> np.ndarray:
    """The array a whole .npy file's bytes (raw) hold, a view of them where its data is
    aligned; head: raw's first bytes as bytes, if the caller has them."""
    head = bytes(memoryview(raw)[:_HEADER_BYTES]) if head is None else head
    dtype, count, offset, shape, order = _layout(_header_of(head), len(raw))
    array = np.frombuffer(raw, dtype, count=count, offset=offset)
    if offset % 16:                              # a foreign header: keep the data aligned
        array = array.copy()
    return array.reshape(shape, order=order)


def _header_of(head: bytes) -> bytes:
    """The header of the .npy file whose first bytes are head; where head holds no whole
    header, all of head that a header may take (_layout then says what is wrong)."""
    if len(head) >= 10 and head[:6] == b"\x93NUMPY" and head[6] in (1, 2, 3):
        width = 2 if head[6] == 1 else 4
        end = 8 + width + int.from_bytes(head[8:8 + width], "little")
        if end <= min(len(head), _HEADER_BYTES):
            return head[:end]
    return head[:_HEADER_BYTES]


@functools.lru_cache(maxsize=1024)
def _layout(header: bytes, size: int) -> tuple:
    """(stored dtype, element count, data offset, shape, order) of a whole .npy file of
    `size` bytes with this header. The files of a dump share a few headers and sizes: each
    distinct pair is parsed and checked once (an exception is raised again each time)."""
    f = io.BytesIO(header)
    shape, fortran, dtype = _npy_header(f)
    dtype = stored_dtype(dtype)
    want = _checked(shape, dtype, size - f.tell())
    return dtype, want // dtype.itemsize, f.tell(), shape, "F" if fortran else "C"


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def stored_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a tensor file's data is read as: its header's, but for 2-byte raw values
    (descr '<V2' or '|V2'), which is how numpy saves an ml_dtypes bfloat16 array: .npy has
    no name for bfloat16, so such a file is read as bfloat16."""
    return BFLOAT16 if dtype.kind == "V" and dtype.itemsize == 2 and dtype.names is None \
        and dtype.subdtype is None else dtype


def _checked(shape, dtype, have: int) -> int:
    """The data bytes the header claims, refused unless a plain numeric array of `have`.
    The messages say what the file is: read_tensor_file puts its path before them."""
    if dtype.hasobject:
        raise ValueError("holds Python objects, which only unpickling could read (refused: "
                         "allow_pickle=False)")
    if dtype.kind not in "biufc" and dtype != BFLOAT16:
        raise ValueError(f"holds {dtype.str} values, not a numeric tensor")
    want = math.prod(shape) * dtype.itemsize
    if have != want:
        raise ValueError(f"is corrupt or cut off: the header's {dtype.str}{list(shape)} needs "
                         f"{want} data bytes, the file holds {have}")
    return want




def npy_header(path: str):
    """(shape, fortran_order, dtype) of an .npy from its header alone."""
    with open_regular(path) as f:
        return _npy_header(f)
