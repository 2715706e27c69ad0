"""Small file helpers every layer uses: atomic writes, JSON reads with one-line errors, and
values made plain JSON."""
from __future__ import annotations

import errno
import json
import math
import os
import stat
import tempfile

# non-blocking: a named pipe where a file should be would block the open, and then the
# read, until something wrote to it (regular files ignore the flag)
READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def open_regular(path: str):
    """A regular file opened to read bytes. A directory raises IsADirectoryError, anything
    else that is not a regular file (a named pipe, a socket, a device) an OSError saying so:
    never an open or a read that waits for a writer."""
    fd = os.open(path, READ_FLAGS)
    try:
        check_regular(fd, path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(fd: int, path: str) -> os.stat_result:
    """fd's status, if it is a regular file; else the OSError open_regular raises."""
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file (a pipe, a socket or a device)", path)
    return st


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else by
    setting it back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str, write, durable: bool = True) -> None:
    """Call write(binary file) on a temporary file beside `path`, then rename it into place:
    the file appears whole or not at all (durable: fsync'd first, surviving a power cut). It
    gets the mode any new file gets (0666 less the umask), not mkstemp's private 0600: a
    workspace is shared by whoever the umask lets read it."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and hasattr(os, "writev") else 1


def _exportable(b):
    """numpy's own types export their buffer; an extension dtype (bfloat16) through a byte
    view."""
    if getattr(b, "dtype", None) is not None and b.dtype.kind not in "biufc":
        return b.reshape(-1).view("u1")
    return b


def write_buffers(path: str, buffers) -> None:
    """A new file holding the buffers (C-contiguous) back to back, in as few system calls as
    the kernel allows (os.writev where it exists). Each call releases the GIL once: a writer
    thread writing a buffer at a time would take the GIL back from the training thread as
    often."""
    views = [memoryview(_exportable(b)) for b in buffers]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)     # less the umask
    try:
        while views:
            if _IOV_MAX > 1:
                written = os.writev(fd, views[:_IOV_MAX])
            else:
                written = os.write(fd, views[0])
            done = 0                        # drop what was written, keep a partial rest
            while done < len(views) and written >= views[done].nbytes:
                written -= views[done].nbytes
                done += 1
            if done == 0 and written == 0 and views[0].nbytes:
                raise OSError(errno.EIO, "the file system accepted no bytes", path)
            views = views[done:]
            if written:
                views[0] = views[0].cast("B")[written:]
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str, durable: bool = True) -> None:
    write_atomic(path, lambda f: f.write(text.encode("utf-8")), durable)


def load_json(path, error, what: str):
    """The parsed JSON of a file; unreadable or malformed files raise `error` in one line."""
    return parse_json(read_bytes(path, error, what), path, error, what)


def read_bytes(path, error, what: str) -> bytes:
    """A file's bytes; an unreadable file raises `error` in one line."""
    try:
        with open_regular(path) as f:
            return f.read()
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None


def parse_json(raw: bytes, path, error, what: str):
    """The JSON of a file's bytes; malformed ones raise `error` in one line."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{what} {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{what} {path} is nested too deeply to be read") from None


def jsonable(value):
    """Plain JSON. A number that is not finite becomes the string "nan", "inf" or "-inf"
    (JSON has no such numbers, and null would not tell them apart); numpy scalars and arrays
    become plain numbers and lists, dataclasses dicts, DataFrames lists of records."""
    import dataclasses

    import numpy as np
    import pandas as pd
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, pd.DataFrame):
        return jsonable(value.to_dict("records"))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return value
