"""The .pt tensor file torch.save writes (msprobe's dump_tensor_data/), read without torch
and without running anything the file asks for.

A .pt is a zip archive: <name>/data.pkl, a pickle that rebuilds the tensor, and
<name>/data/<key>, the raw bytes of each storage it names, in the byte order of
<name>/byteorder. The pickle is read by an unpickler whose every global is a stand-in of
ours: the tensor rebuild (torch._utils._rebuild_tensor_v2, _rebuild_parameter), the typed
storages (torch.FloatStorage...) and the empty OrderedDict of backward hooks. A pickle that
names anything else (os.system, a class of the script's) is refused before anything of it is
called: a tensor file holds a tensor, nothing more. The sizes, offsets and strides it gives
are checked against the storage's bytes before a view is made."""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import zipfile
import ml_dtypes
import numpy as np

_STORAGES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
    """torch.<X>Storage as a pickle names it: only its dtype matters."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


class _Storage:
    def __init__(self, dtype: np.dtype, key: str, numel: int):
        self.dtype, self.key, self.numel = dtype, key, numel


class _Tensor:
    """What _rebuild_tensor_v2 was asked to make: a view of a storage."""

    def __init__(self, storage, offset, size, stride):
        if not isinstance(storage, _Storage):
            raise ValueError("its tensor is not made from a storage")
        for name, v in (("size", size), ("stride", stride)):
            if not isinstance(v, tuple) or not all(isinstance(d, int) and d >= 0 for d in v):
                raise ValueError(f"its tensor's {name} is not a tuple of counts")
        if len(size) != len(stride) or not isinstance(offset, int) or offset < 0:
            raise ValueError("its tensor's size, stride and offset disagree")
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None,
                       metadata=None):
    return _Tensor(storage, offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, hooks=None):
    return data


_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("collections", "OrderedDict"): collections.OrderedDict}
_GLOBALS.update({("torch", name): _StorageType(dt) for name, dt in _STORAGES.items()})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        found = _GLOBALS.get((module, name))
        if found is None:
            raise ValueError(f"is refused: its pickle asks for {module}.{name}, and a tensor "
                             f"file may only rebuild a tensor (nothing in it is run)")
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and isinstance(pid[4], int) and pid[4] >= 0):
            raise ValueError(f"is refused: its pickle names a storage that is not a typed "
                             f"tensor storage ({str(pid)[:80]})")
        return _Storage(pid[1].dtype, pid[2], pid[4])


def read_pt(fd: int, mmap_over: float = math.inf) -> np.ndarray:
    """The tensor of the .pt file open on fd (read-only where its storage is mapped, a storage
    larger than mmap_over bytes stored uncompressed). Errors are ValueErrors saying what the
    file is (read_tensor_file puts its path before them)."""
    with os.fdopen(os.dup(fd), "rb") as f:
        try:
            archive = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise ValueError(f"is corrupt: not a torch.save archive ({e})") from None
        with archive:
            names = archive.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise ValueError("is not a torch.save archive of a tensor (no data.pkl)")
            prefix = pkl[0][:-len("data.pkl")]
            try:
                obj = _Unpickler(io.BytesIO(archive.read(pkl[0]))).load()
            except ValueError:
                raise
            except Exception as e:   # any opcode a damaged pickle trips on
                raise ValueError(f"is corrupt: its pickle cannot be read ({type(e).__name__}: "
                                 f"{e})") from None
            if not isinstance(obj, _Tensor):
                raise ValueError(f"holds a {type(obj).__name__}, not a tensor")
            order = prefix + "byteorder"
            big = order in names and archive.read(order).strip() == b"big"
            return _view(archive, f, prefix + "data/" + obj.storage.key, obj, big, mmap_over)


def _view(archive: zipfile.ZipFile, f, member: str, t: _Tensor, big: bool,
          mmap_over: float) -> np.ndarray:
    try:
        info = archive.getinfo(member)
    except KeyError:
        raise ValueError(f"is cut off: its storage {member} is missing") from None
    dtype = t.storage.dtype.newbyteorder(">") if big and t.storage.dtype.itemsize > 1 \
        else t.storage.dtype
    itemsize = dtype.itemsize
    if info.file_size != t.storage.numel * itemsize:
        raise ValueError(f"is corrupt or cut off: its storage holds {info.file_size} bytes, "
                         f"the pickle says {t.storage.numel} x {itemsize}")
    count = math.prod(t.size)
    last = t.offset + sum((d - 1) * s for d, s in zip(t.size, t.stride)) if count else 0
    if count and last >= t.storage.numel:
        raise ValueError(f"is corrupt: its tensor {list(t.size)} reaches past its storage of "
                         f"{t.storage.numel} elements")
    mapped = info.compress_type == zipfile.ZIP_STORED and info.file_size > mmap_over
    if mapped:
        data = _mapped(f, info, dtype, t.storage.numel)
    else:
        try:
            raw = archive.read(member)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise ValueError(f"is corrupt: its storage cannot be read ({e})") from None
        data = np.frombuffer(bytearray(raw), dtype)     # writable, as a small .npy's
    if not count:
        return np.zeros(t.size, t.storage.dtype)
    view = np.lib.stride_tricks.as_strided(data[t.offset:], t.size,
                                           tuple(s * itemsize for s in t.stride),
                                           writeable=not mapped)
    if not view.flags.c_contiguous:         # a transposed or expanded view: made whole
        view = np.ascontiguousarray(view)
    return view.astype(t.storage.dtype, copy=False)     # native byte order


def _mapped(f, info: zipfile.ZipInfo, dtype, numel: int) -> np.ndarray:
    """A stored (uncompressed) member mapped read-only: its data follows its local header."""
    f.seek(info.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValueError("is corrupt: a zip member's header is broken")
    start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") \
        + int.from_bytes(local[28:30], "little")
    return np.memmap(f, dtype=dtype, mode="r", offset=start, shape=(numel,))
