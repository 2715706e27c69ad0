"""Dumps written by msprobe (mindstudio-probe), PyTorch's or MindSpore's:

    DUMP/step<N>/rank<R>/            (proc<PID>, or rank, where no rank was known)
        dump.json                    task, level, framework, and data: every API or module
                                     call in execution order -> its input_args,
                                     input_kwargs (a backward's: input), output (and parameters,
                                     parameters_grad at level L0 and mix), each tensor
                                     with dtype, shape, Max, Min, Mean, Norm (md5 where
                                     asked) and, in a tensor dump, its data_name
        dump_tensor_data/<data_name> .pt (PyTorch, formats.torchfile) or .npy (MindSpore)
        stack.json                   index -> [[call names], [frames]]
        construct.json               call name -> the module call it ran in (L0, mix)

A run of the workspace is one rank of such a dump, imported by reference: its run.json
records where the dump is (source) and which rank (rank); its steps are the dump's
step<N> directories for that rank, read here. A step whose dump.json is missing was cut
off (msprobe writes it when the step ends): partial.

The index has a row per tensor, as ours does. Outputs are named <call>:<k>. msprobe does not
say which call made an input: an input whose dtype, shape, Max and Min are exactly those of
an earlier output is that output (of several, the latest with its md5, else the latest whose
Mean and Norm agree to 1e-3: those are sums, which a device may compute in another order),
which gives the analysis its data flow; any other input is named <call>.input.<k> and
stands for itself. A compare matches an input to the reference's by that name, else by its
position (<call>, input, k).
A statistics or md5 dump has no file: its rows are compared by their statistics. msprobe's
statistics say whether a tensor holds nan or inf (a Max or Min that is one), not how many:
such a row's counts are 1, "at least one"."""
from __future__ import annotations

import math
import os
import re
from typing import Dict, List, Optional, Tuple

from ...errors import WorkspaceError
from ...fileio import load_json
from ...table import Table
from .ours import INDEX_COLUMNS

DUMP_FILE, STACK_FILE, CONSTRUCT_FILE = "dump.json", "stack.json", "construct.json"
TENSOR_DIR = "dump_tensor_data"
STEP_DIR = re.compile(r"step(\d+)")
RANK_DIR = re.compile(r"rank(\d*)|proc(\d+)")
TASKS = ("tensor", "statistics", "md5")
# an API call: <api>.<n>.<forward|backward>; a module's: Module.<path>.<Class>.<dir>.<n>
_API = re.compile(r"^(?P<api>.+)\.(?P<n>\d+)\.(?P<dir>forward|backward)$")
_MODULE = re.compile(r"^Module\.(?P<path>.+)\.(?P<cls>[^.]+)\.(?P<dir>forward|backward|"
                     r"parameters_grad)(?:\.(?P<n>\d+))?$")
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
           "float64": "float64", "int64": "int64", "int32": "int32", "int16": "int16",
           "int8": "int8", "uint8": "uint8", "bool": "bool", "float": "float32",
           "half": "float16", "double": "float64", "long": "int64", "int": "int32"}


def claims(step_dir: str) -> bool:
    return os.path.isfile(os.path.join(step_dir, DUMP_FILE))


def is_dump(path: str) -> bool:
    """Whether path is an msprobe dump: its root, a step<N> directory or a rank's."""
    try:
        return bool(ranks_of(path))
    except WorkspaceError:
        return False


def ranks_of(path: str) -> Dict[str, Dict[int, str]]:
    """The ranks a dump holds (rank directory name -> step -> that step's directory), from
    its root, one step<N> directory or one rank's directory (one rank: that one). Empty
    where path is none of these."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    if RANK_DIR.fullmatch(base) and STEP_DIR.fullmatch(os.path.basename(os.path.dirname(path))):
        found = ranks_of(os.path.dirname(os.path.dirname(path)))
        return {base: found.get(base, {})} if base in found else {}
    steps = [(int(m.group(1)), os.path.join(path, d)) for d in _listdir(path)
             if (m := STEP_DIR.fullmatch(d))]
    if not steps and STEP_DIR.fullmatch(base):
        steps = [(int(STEP_DIR.fullmatch(base).group(1)), path)]
    out: Dict[str, Dict[int, str]] = {}
    for step, step_dir in sorted(steps):
        for d in _listdir(step_dir):
            if RANK_DIR.fullmatch(d) and os.path.isdir(os.path.join(step_dir, d)):
                out.setdefault(d, {})[step] = os.path.join(step_dir, d)
    return dict(sorted(out.items(), key=lambda kv: _rank_key(kv[0])))


def _rank_key(name: str):
    m = RANK_DIR.fullmatch(name)
    return (0 if m.group(1) is not None else 1, int(m.group(1) or m.group(2) or -1))


def rank_number(name: str) -> Optional[int]:
    """rank<R> -> R; None for proc<PID> and a bare rank (no rank was known)."""
    m = RANK_DIR.fullmatch(name)
    return int(m.group(1)) if m and m.group(1) else None


def _listdir(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except (NotADirectoryError, FileNotFoundError):
        return []
    except OSError as e:
        raise WorkspaceError(f"cannot list {path}: {e.strerror}") from None


def read_dump_json(step_dir: str) -> dict:
    """dump.json, checked to be msprobe's: a task, and data as call -> record. A file cut
    short or damaged is an error naming it, never an empty step."""
    path = os.path.join(step_dir, DUMP_FILE)
    data = load_json(path, WorkspaceError, "msprobe dump")
    if not isinstance(data, dict) or not isinstance(data.get("data"), dict):
        raise WorkspaceError(f"msprobe dump {path} is not msprobe's dump.json: no data object "
                             f"of calls")
    if data.get("task") not in TASKS:
        raise WorkspaceError(f"msprobe dump {path} has task {data.get('task')!r}: this tool "
                             f"reads {', '.join(TASKS)} dumps")
    if not data["data"]:
        raise WorkspaceError(f"msprobe dump {path} holds no call: the dump was on while "
                             f"nothing it watches ran (its scope or list, or start() after "
                             f"the model ran?)")
    return data


def read_index(step_dir: str, kind: str) -> Table:
    data = read_dump_json(step_dir)
    rows = []
    made: Dict[tuple, list] = {}        # an output's signature -> [(name, mean, norm)]
    reads: Dict[str, list] = {}         # a forward output -> [(reader, input position)]
    outputs: Dict[str, int] = {}        # call -> how many outputs it has, as dumped so far
    for call, record, ins, outs, kinds in _calls_of(data["data"], step_dir):
        op_type = call_type(call)
        for io_, tensors in (("input", ins), ("output", outs)):
            for k, t in enumerate(tensors):
                sig = _signature(t)
                if io_ == "output":
                    tensor = f"{call}:{k}"
                    if sig is not None:
                        made.setdefault(sig, []).append(
                            (tensor, _number(t.get("Mean")), _number(t.get("Norm")),
                             t.get("md5")))
                else:
                    tensor = _producer(made.get(sig, ()), t) if sig is not None else None
                    if tensor and _FORWARD in call:
                        reads.setdefault(tensor, []).append((call, k))
                    tensor = tensor or _gradient_from(call, k, reads, outputs) \
                        or f"{call}.input.{k}"
                row = _row(t, op_type, call, io_, k, tensor, step_dir)
                row["sum_kind"] = kinds[k] if io_ == "output" and k < len(kinds) else ""
                rows.append(row)
        outputs[call] = len(outs)
    names = list(dict.fromkeys([*INDEX_COLUMNS, "max", "min", "mean", "l2norm", "nan_count",
                                "pos_inf_count", "neg_inf_count", "md5", "requires_grad",
                                "sum_kind", "timestamp"]))
    if not rows:
        raise WorkspaceError(f"msprobe dump {os.path.join(step_dir, DUMP_FILE)} holds no "
                             f"tensor (every call's arguments are other values)")
    for k, r in enumerate(rows):
        r["timestamp"] = float(k)       # execution order: the dump's own
    return Table.from_rows(rows, names)


_FORWARD, _BACKWARD = ".forward", ".backward"


def _gradient_from(call: str, k: int, reads: dict, outputs: dict) -> Optional[str]:
    """Where a backward's input k (the gradient of its forward's output k) came from, when
    its statistics did not say: the backward of the forward call that last read that
    output, dumped before it (its output at the position the reader read it, else its
    first). msprobe's backward records hold the gradients that pass a call, not every
    gradient its kernels make, so this is the data flow the dump can show."""
    if not call.endswith(_BACKWARD) and _BACKWARD + "." not in call:
        return None
    forward = _FORWARD.join(call.rsplit(_BACKWARD, 1))
    for reader, j in reversed(reads.get(f"{forward}:{k}", ())):
        back = _BACKWARD.join(reader.rsplit(_FORWARD, 1))
        n = outputs.get(back)
        if n:
            return f"{back}:{j if j < n else 0}"
    return None


# the APIs that change a tensor's dtype and compute nothing else: where one run's tensor is
# already in the target dtype (a golden that computes in float32 whatever the script casts
# to), the call returns its input and records no backward there
CAST_APIS = frozenset({"Tensor.float", "Tensor.half", "Tensor.bfloat16", "Tensor.double",
                       "Tensor.to", "Tensor.type", "Tensor.type_as"})


def call_type(call: str) -> str:
    """What a call is, as the op type column says: Functional.linear for
    Functional.linear.0.forward, Module.Linear for a module's call."""
    m = _MODULE.match(call)
    if m:
        return f"Module.{m.group('cls')}"
    m = _API.match(call)
    return m.group("api") if m else call


def _calls_of(data: dict, step_dir: str):
    """(call, record, input tensors, output tensors, the outputs' sum kinds) of each call
    in execution order. A module's parameters_grad record (L0, mix) is one call per
    parameter, named as msprobe's compare names its rows (Module.fc.Linear.parameters_grad.0
    .bias), whose inputs are what the gradient is made from: the gradient the module's
    output received (its backward's input) and, for a weight, the module's forward input.
    A bias's gradient sums the first over the batch, a weight's contracts the two: the
    compare can then tell a gradient that is zero up to rounding (cancellation) from a
    diverging one, as it does for a script's own calls."""
    for call, record in data.items():
        if not isinstance(record, dict):
            raise WorkspaceError(f"msprobe dump {os.path.join(step_dir, DUMP_FILE)}: the "
                                 f"record of {call!r} is not an object")
        m = _MODULE.match(call)
        if m and m.group("dir") == "parameters_grad":
            base = call[:-len(f"parameters_grad.{m.group('n')}")] if m.group("n") \
                else call[:-len("parameters_grad")]
            n = m.group("n") or "0"
            back = data.get(f"{base}backward.{n}")
            forward = data.get(f"{base}forward.{n}")
            grad_out = _flat(back.get("input")) if isinstance(back, dict) else []
            x = _flat(forward.get("input_args"))[:1] if isinstance(forward, dict) else []
            for param, value in record.items():
                outs = _flat(value)
                if not outs:
                    continue
                contraction = len(outs[0].get("shape") or ()) > 1
                ins = grad_out + (x if contraction else [])
                kind = "contraction" if contraction and x else "sum"
                yield f"{call}.{param}", record, ins if grad_out else [], outs, \
                    [kind if grad_out else ""] * len(outs)
            continue
        ins, outs = _tensors_of(record, call)
        yield call, record, ins, outs, []


def _tensors_of(record: dict, call: str) -> Tuple[list, list]:
    """A call's input tensors (args, kwargs, a backward's input, then a module's
    parameters) and its outputs, each in the order the record lists them."""
    inputs = _flat(record.get("input_args")) + _flat(record.get("input_kwargs")) \
        + _flat(record.get("input")) + _flat(record.get("parameters"))
    return inputs, _flat(record.get("output"))


def _flat(value) -> list:
    out: list = []

    def walk(v):
        if isinstance(v, dict):
            if _is_tensor(v):
                out.append(v)
            else:
                for x in v.values():
                    walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    walk(value)
    return out


def _is_tensor(v: dict) -> bool:
    return isinstance(v.get("type"), str) and v["type"].endswith(("Tensor", "ndarray")) \
        and isinstance(v.get("shape"), list)


def _number(v) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):            # msprobe writes nan and inf as text in some versions
        try:
            return float(v)
        except ValueError:
            return math.nan
    return math.nan


def _signature(t: dict) -> Optional[tuple]:
    """What an input must share with the output it is: dtype, shape, extremes."""
    hi, lo = _number(t.get("Max")), _number(t.get("Min"))
    if hi != hi or lo != lo:            # unknown or nan: too weak to say where it came from
        return None
    return (str(t.get("dtype")), tuple(t.get("shape")), hi, lo)


def _producer(candidates, t: dict) -> Optional[str]:
    """Of the earlier outputs with an input's signature, the latest with its md5, else the
    latest whose Mean and Norm agree with the input's to 1e-3, else the latest. (An md5
    taken of an in-place call's input after the call may not be the one its producer's
    output had: it decides only where it agrees.)"""
    mean, norm, md5 = _number(t.get("Mean")), _number(t.get("Norm")), t.get("md5")
    if md5:
        for name, _, _, made_md5 in reversed(candidates):
            if made_md5 == md5:
                return name
    for name, m, n, _ in reversed(candidates):
        if _close(m, mean) and _close(n, norm):
            return name
    return candidates[-1][0] if candidates else None


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-3 * max(abs(a), abs(b))


def dtype_name(text) -> str:
    """torch.float16 / Float16 / float16 -> float16; what numpy and the compare call it."""
    name = str(text).rsplit(".", 1)[-1].lower()
    return _DTYPES.get(name, name)


def _row(t: dict, op_type: str, call: str, io_: str, k: int, tensor: str, step_dir: str) -> dict:
    shape = t.get("shape")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WorkspaceError(f"msprobe dump {os.path.join(step_dir, DUMP_FILE)}: {call} "
                             f"{io_} {k} has shape {shape!r}")
    hi, lo, mean, norm = (_number(t.get(x)) for x in ("Max", "Min", "Mean", "Norm"))
    name = t.get("data_name")
    if name is not None and (not isinstance(name, str) or "/" in name or name in ("", ".", "..")):
        raise WorkspaceError(f"msprobe dump {os.path.join(step_dir, DUMP_FILE)}: {call} names "
                             f"the file {name!r}, which is not a file of {TENSOR_DIR}/")
    # a max or min is nan exactly where the tensor holds one (torch's reductions propagate
    # it); an unknown one (an integer tensor's mean, a stat not dumped) says nothing
    nan = (hi != hi and t.get("Max") is not None) or (lo != lo and t.get("Min") is not None)
    return {"op_type": op_type, "op_name": call, "io": io_, "index": float(k), "tensor": tensor,
            "dtype": dtype_name(t.get("dtype")), "shape": " ".join(map(str, shape)),
            "file": f"{TENSOR_DIR}/{name}" if name else "",
            "max": hi, "min": lo, "mean": mean, "l2norm": norm,
            "nan_count": float(nan), "pos_inf_count": float(hi == math.inf),
            "neg_inf_count": float(lo == -math.inf), "md5": t.get("md5") or "",
            # a leaf that requires grad (no call made it): a parameter, for ranks' agreement
            "requires_grad": {True: "true", False: "false"}.get(t.get("requires_grad"), "")}


def read_calls(step_dir: str) -> dict:
    """call -> {"module": the module path it ran in (construct.json, L0 and mix), "source":
    the script's line that made it (stack.json: the first frame outside torch, MindSpore
    and msprobe)}; {} where neither file is there."""
    out: Dict[str, dict] = {}
    construct_path = os.path.join(step_dir, CONSTRUCT_FILE)
    if os.path.isfile(construct_path):
        construct = load_json(construct_path, WorkspaceError, "msprobe module tree")
        if isinstance(construct, dict):
            for call, parent in construct.items():
                path = module_path(parent) if isinstance(parent, str) else ""
                if path:
                    out.setdefault(call, {})["module"] = path
    stack_path = os.path.join(step_dir, STACK_FILE)
    if os.path.isfile(stack_path):
        stacks = load_json(stack_path, WorkspaceError, "msprobe call stacks")
        for entry in (stacks.values() if isinstance(stacks, dict) else ()):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                    and isinstance(entry[1], list)):
                continue
            line = _script_line(entry[1])
            for call in entry[0]:
                if isinstance(call, str) and line:
                    out.setdefault(call, {})["source"] = line
    return out


def module_path(module_call: str) -> str:
    """Module.blocks.0.attn.Attention.forward.0 -> blocks.0.attn."""
    m = _MODULE.match(module_call)
    return m.group("path") if m else ""


_FRAME = re.compile(r"^File (?P<file>.+?), line (?P<line>\d+), in (?P<func>[^,]+)")
_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\](?:torch|mindspore|msprobe|torch_npu)"
                      r"[/\\]")


def _script_line(frames: list) -> str:
    for frame in frames:
        m = _FRAME.match(frame) if isinstance(frame, str) else None
        if m and not _LIBRARY.search(m.group("file")):
            return f"{m.group('file')}:{m.group('line')} in {m.group('func')}"
    return ""


def describe(step_dir: str) -> dict:
    """What a step's dump.json says of itself (task, level, framework), for run.json."""
    data = read_dump_json(step_dir)
    return {k: data.get(k) for k in ("task", "level", "framework") if isinstance(data.get(k), str)}

