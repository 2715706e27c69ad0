"""The .pt tensor file torch.save writes (msprobe's dump_tensor_data/), read without torch
and without running anything the file asks for.

A .pt is a zip archive: <name>/data.pkl, a pickle that rebuilds the tensor, and
<name>/data/<key>, the raw bytes of each storage it names, in the byte order of
<name>/byteorder. The pickle is not unpickled: `_rebuild` interprets the few opcodes
torch.save writes (a stack machine of constants, tuples, dicts and calls), and a call may
only be one of our stand-ins for the names a tensor's pickle uses: the tensor rebuild
(torch._utils._rebuild_tensor_v2, _rebuild_parameter), the typed storages
(torch.FloatStorage...) and the empty OrderedDict of backward hooks. A pickle that names
anything else (os.system, a class of the script's), or uses an opcode outside that set, is
refused: a tensor file holds a tensor, nothing more. The sizes, offsets and strides it gives
are checked against the storage's bytes before a view is made."""
from __future__ import annotations

import math
import os
import struct
import zipfile
import zlib

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


def _ordered_dict(*items):
    if items:
        raise ValueError("its backward hooks are not empty")
    return {}


_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("collections", "OrderedDict"): _ordered_dict}
_GLOBALS.update({("torch", name): _StorageType(dt) for name, dt in _STORAGES.items()})


class _Mark:
    pass


_MARK = _Mark()


def _storage(pid):
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
            and isinstance(pid[4], int) and pid[4] >= 0):
        raise ValueError(f"is refused: its pickle names a storage that is not a typed tensor "
                         f"storage ({str(pid)[:80]})")
    return _Storage(pid[1].dtype, pid[2], pid[4])


def _rebuild(data: bytes):
    """The object a tensor's pickle (protocol 2 to 5, as torch.save writes it) describes,
    interpreted opcode by opcode; ValueError for anything a tensor's pickle does not hold."""
    stack: list = []
    memo: dict = {}
    pos, end = 0, len(data)

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > end:
            raise ValueError("is corrupt: its pickle is cut off")
        chunk = data[pos:pos + n]
        pos += n
        return chunk

    def line() -> str:
        nonlocal pos
        stop = data.find(b"\n", pos)
        if stop < 0:
            raise ValueError("is corrupt: its pickle is cut off")
        text = data[pos:stop].decode("utf-8")
        pos = stop + 1
        return text

    def since_mark() -> list:
        for k in range(len(stack) - 1, -1, -1):
            if stack[k] is _MARK:
                items = stack[k + 1:]
                del stack[k:]
                return items
        raise ValueError("is corrupt: its pickle has no mark")

    def pop():
        if not stack or stack[-1] is _MARK:
            raise ValueError("is corrupt: its pickle's stack is empty")
        return stack.pop()

    while True:
        op = take(1)
        if op == b".":                                  # STOP
            return pop()
        if op == b"\x80":                               # PROTO
            take(1)
        elif op == b"\x95":                             # FRAME
            take(8)
        elif op in (b"c", b"\x93"):                     # GLOBAL, STACK_GLOBAL
            if op == b"c":
                module, name = line(), line()
            else:
                name, module = pop(), pop()
                if not (isinstance(module, str) and isinstance(name, str)):
                    raise ValueError("is corrupt: its pickle names a global by no name")
            found = _GLOBALS.get((module, name))
            if found is None:
                raise ValueError(f"is refused: its pickle asks for {module}.{name}, and a "
                                 f"tensor file may only rebuild a tensor (nothing in it is run)")
            stack.append(found)
        elif op in (b"q", b"r", b"\x94"):               # BINPUT, LONG_BINPUT, MEMOIZE
            key = take(1)[0] if op == b"q" else struct.unpack("<I", take(4))[0] \
                if op == b"r" else len(memo)
            memo[key] = stack[-1] if stack else None
        elif op in (b"h", b"j"):                        # BINGET, LONG_BINGET
            key = take(1)[0] if op == b"h" else struct.unpack("<I", take(4))[0]
            if key not in memo:
                raise ValueError("is corrupt: its pickle reads a memo it never wrote")
            stack.append(memo[key])
        elif op == b"(":
            stack.append(_MARK)
        elif op == b"t":
            stack.append(tuple(since_mark()))
        elif op == b")":
            stack.append(())
        elif op in (b"\x85", b"\x86", b"\x87"):        # TUPLE1-3
            n = op[0] - 0x84
            items = [pop() for _ in range(n)][::-1]
            stack.append(tuple(items))
        elif op == b"X":                                # BINUNICODE
            stack.append(take(struct.unpack("<I", take(4))[0]).decode("utf-8"))
        elif op == b"\x8c":                             # SHORT_BINUNICODE
            stack.append(take(take(1)[0]).decode("utf-8"))
        elif op == b"K":
            stack.append(take(1)[0])
        elif op == b"M":
            stack.append(struct.unpack("<H", take(2))[0])
        elif op == b"J":
            stack.append(struct.unpack("<i", take(4))[0])
        elif op == b"\x8a":                             # LONG1
            stack.append(int.from_bytes(take(take(1)[0]), "little", signed=True))
        elif op == b"G":
            stack.append(struct.unpack(">d", take(8))[0])
        elif op == b"\x88":
            stack.append(True)
        elif op == b"\x89":
            stack.append(False)
        elif op == b"N":
            stack.append(None)
        elif op == b"}":
            stack.append({})
        elif op == b"]":
            stack.append([])
        elif op in (b"s", b"u"):                        # SETITEM, SETITEMS
            items = [pop(), pop()][::-1] if op == b"s" else since_mark()
            target = pop()
            if not isinstance(target, dict) or len(items) % 2:
                raise ValueError("is corrupt: its pickle sets items of no dict")
            for k in range(0, len(items), 2):
                target[items[k]] = items[k + 1]
            stack.append(target)
        elif op in (b"a", b"e"):                        # APPEND, APPENDS
            items = [pop()] if op == b"a" else since_mark()
            target = pop()
            if not isinstance(target, list):
                raise ValueError("is corrupt: its pickle appends to no list")
            stack.append(target + items)
        elif op == b"Q":                                # BINPERSID
            stack.append(_storage(pop()))
        elif op == b"R":                                # REDUCE: one of our stand-ins only
            args, fn = pop(), pop()
            if not isinstance(args, tuple):
                raise ValueError("is corrupt: its pickle calls with no argument tuple")
            if isinstance(fn, _StorageType) or not callable(fn) or \
                    fn not in _GLOBALS.values():
                raise ValueError("is refused: its pickle calls something that rebuilds no "
                                 "tensor")
            stack.append(fn(*args))
        else:
            raise ValueError(f"is refused: its pickle uses opcode {op!r}, which no tensor's "
                             f"pickle needs")


def read_pt(fd: int, mmap_over: float = math.inf) -> np.ndarray:
    """The tensor of the .pt file open on fd (read-only where its storage is mapped, a storage
    larger than mmap_over bytes stored uncompressed). Errors are ValueErrors saying what the
    file is (read_tensor_file puts its path before them)."""
    with os.fdopen(os.dup(fd), "rb") as f:
        try:
            archive = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError,
                ValueError) as e:
            raise ValueError(f"is corrupt: not a torch.save archive ({e})") from None
        try:
            with archive:
                return _read(archive, f, mmap_over)
        # a member damaged; a compression or encryption this zip reader does not take
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError,
                RuntimeError) as e:
            raise ValueError(f"is corrupt: {e}") from None


def _read(archive: zipfile.ZipFile, f, mmap_over: float) -> np.ndarray:
    names = archive.namelist()
    pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise ValueError("is not a torch.save archive of a tensor (no data.pkl)")
    prefix = pkl[0][:-len("data.pkl")]
    try:
        obj = _rebuild(archive.read(pkl[0]))
    except ValueError:
        raise
    except (TypeError, UnicodeDecodeError, struct.error, RecursionError) as e:
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


# -- writing ------------------------------------------------------------------------------------
_STORAGE_OF = {np.dtype(dt): name for name, dt in _STORAGES.items()}


def _text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if -2 ** 31 <= v < 2 ** 31:
        return b"J" + struct.pack("<i", v)
    return b"\x8a\x08" + v.to_bytes(8, "little", signed=True)


def _ints(values) -> bytes:
    return b"(" + b"".join(_int(v) for v in values) + b"t"


def tensor_pickle(dtype: np.dtype, shape: tuple) -> bytes:
    """The data.pkl torch.save writes for a contiguous tensor of this dtype and shape whose
    storage is data/0: the few opcodes _rebuild reads (protocol 2)."""
    storage = _STORAGE_OF.get(np.dtype(dtype))
    if storage is None:
        raise ValueError(f"a {dtype} tensor has no torch storage")
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n("
            b"(" + _text("storage") + f"ctorch\n{storage}\n".encode() + _text("0")
            + _text("cpu") + _int(math.prod(shape)) + b"tQ"
            + _int(0) + _ints(shape) + _ints(reversed(strides))
            + b"\x89ccollections\nOrderedDict\n)Rt" + b"R.")


def write_pt(path: str, array: np.ndarray) -> None:
    """array as torch.save would write it (little-endian, stored, the storage aligned to 64
    bytes), readable by torch.load(weights_only=True) and by read_pt; written under a
    temporary name and renamed, so that it is whole or absent."""
    from ...fileio import write_atomic
    array = np.asarray(array)
    if not array.flags.c_contiguous:       # (ascontiguousarray would make a 0-d array 1-d)
        array = array.copy(order="C")
    dtype = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
    name = os.path.splitext(os.path.basename(path))[0] or "archive"

    def write(f):
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
            z.writestr(f"{name}/data.pkl", tensor_pickle(array.dtype, array.shape))
            z.writestr(f"{name}/byteorder", "little")
            info = zipfile.ZipInfo(f"{name}/data/0")
            # torch aligns a storage to 64 bytes with padding in the local header's extra field
            header = 30 + len(info.filename.encode("utf-8"))
            pad = (-(f.tell() + header + 4)) % 64
            info.extra = struct.pack("<HH", 0xF5F5, pad) + b"Z" * pad
            z.writestr(info, array.astype(dtype, copy=False).tobytes())
            z.writestr(f"{name}/version", "3\n")
    write_atomic(path, write, durable=False)
