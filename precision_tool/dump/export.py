"""A run's dumped steps written in msprobe's layout, for msprobe's own compare and whatever
else reads it:

    OUT/step<N>/rank<R>/dump.json, stack.json, construct.json, dump_tensor_data/*.pt

Each op of a step is a call, in the step's execution order: a PyTorch script's keeps its
name (Functional.linear.0.forward), a graph's op becomes <OpType>.<op name, mangled>.0.forward
(msprobe's names have no '/'). Each of its index rows is an input or an output tensor, written
as torch.save writes a tensor (formats.torchfile.write_pt: no torch needed), in its logical
layout (an NPU tensor in NC1HWC0 back to NCHW), with its statistics; a step dumped as
statistics only is exported as msprobe's statistics task. The source line of a script's calls
goes to stack.json. The whole export is written beside OUT and renamed to it when done: an
interrupted one is never found whole."""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, List, Optional

import numpy as np

from ..errors import WorkspaceError
from .. import numerics
from . import layout
from .formats.msprobe import DUMP_FILE, STACK_FILE, CONSTRUCT_FILE, TENSOR_DIR
from .formats.npy import BFLOAT16
from .formats.torchfile import write_pt
from .run import Run

_CALL = re.compile(r"^.+\.\d+\.(forward|backward)$")


def call_name(op_type: str, op_name: str) -> str:
    """The msprobe call an op is exported as (see the module)."""
    if _CALL.match(op_name) and "/" not in op_name:
        return op_name
    return f"{layout.mangle(op_type, 64)}.{layout.mangle(op_name)}.0.forward"


def export_msprobe(ws, run: Run, out: str, steps: Optional[List[int]] = None, rank: int = 0,
                   progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """The run's steps (default: every complete one) as an msprobe dump at out, which must
    not exist yet. Returns what was written: {"path", "steps", "calls", "tensors", "bytes"}."""
    out = os.path.abspath(out)
    if os.path.exists(out):
        raise WorkspaceError(f"{out} exists: name a directory the export can make")
    steps = sorted(run.complete_steps if steps is None else steps)
    if not steps:
        raise WorkspaceError(f"{run.label} has no complete dumped step to export")
    for step in steps:
        ws.resolve_step(run, step)
    building = f"{out}.partial"
    shutil.rmtree(building, ignore_errors=True)
    done = {"path": out, "steps": steps, "calls": 0, "tensors": 0, "bytes": 0}
    try:
        for k, step in enumerate(steps):
            _export_step(ws, run, step, os.path.join(building, f"step{step}", f"rank{rank}"),
                         done)
            if progress is not None:
                progress(k + 1, len(steps))
        os.rename(building, out)
    except OSError as e:
        shutil.rmtree(building, ignore_errors=True)
        raise WorkspaceError(f"cannot export {run.label} to {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return done


def _export_step(ws, run: Run, step: int, where: str, done: dict) -> None:
    os.makedirs(os.path.join(where, TENSOR_DIR))
    rows = ws.index_table(run, step).records()
    with_files = any(r["file"] for r in rows)
    sites = ws.call_sites(run, step)
    data: dict = {}
    stacks: dict = {}
    for r in rows:
        call = call_name(r["op_type"], r["op_name"])
        record = data.setdefault(call, {"input_args": [], "input_kwargs": {}, "output": []})
        entry = {"type": "torch.Tensor", "dtype": f"torch.{r['dtype']}",
                 "shape": [int(d) for d in str(r["shape"]).split()], "requires_grad": False}
        if with_files and r["file"]:
            value = _logical(ws.load(run, step, r["file"], r["shape"]), r)
            name = f"{call}.{r['io']}.{len(record['input_args' if r['io'] == 'input' else 'output'])}.pt"
            write_pt(os.path.join(where, TENSOR_DIR, name), value)
            entry.update(_stats(value), shape=list(value.shape), data_name=name)
            done["tensors"] += 1
            done["bytes"] += value.nbytes
        else:
            entry.update({"Max": r["max"], "Min": r["min"], "Mean": r["mean"],
                          "Norm": r["l2norm"]})
        record["input_args" if r["io"] == "input" else "output"].append(entry)
        source = sites.get(r["op_name"], {}).get("source")
        if source and call not in stacks:
            path, _, rest = source.partition(":")
            line, _, func = rest.partition(" in ")
            stacks[call] = [f"File {path}, line {line}, in {func or '?'}, \n "]
    done["calls"] += len(data)
    dump = {"task": "tensor" if with_files else "statistics", "level": "L1",
            "framework": "pytorch",
            "dump_data_dir": os.path.join(where, TENSOR_DIR) if with_files else None,
            "data": data}
    _write_json(os.path.join(where, DUMP_FILE), dump)
    _write_json(os.path.join(where, STACK_FILE),
                {str(k): [[call], frames] for k, (call, frames) in enumerate(stacks.items())})
    _write_json(os.path.join(where, CONSTRUCT_FILE), {})


def _logical(value: np.ndarray, row: dict) -> np.ndarray:
    """An NPU tensor in NC1HWC0 back in NCHW (what the model's op holds)."""
    if row.get("format") == "NC1HWC0" and row.get("original_shape"):
        dims = [int(d) if d.isdigit() else value.shape[0]
                for d in str(row["original_shape"]).split()]
        return numerics.five_hd_to_nchw(value, dims)
    return value


def _stats(value: np.ndarray) -> dict:
    """Max, Min, Mean, Norm as msprobe records them (nan/inf where the tensor holds them;
    None for an empty tensor, and Mean and Norm for an integer or boolean one)."""
    if value.size == 0:
        return {"Max": None, "Min": None, "Mean": None, "Norm": None}
    floating = value.dtype.kind in "fc" or value.dtype == BFLOAT16
    x = value.astype(np.float64) if floating else value
    with np.errstate(all="ignore"):
        return {"Max": _plain(x.max()), "Min": _plain(x.min()),
                "Mean": _plain(x.mean()) if floating else None,
                "Norm": _plain(np.sqrt(np.sum(x * x))) if floating else None}


def _plain(v):
    v = v.item() if hasattr(v, "item") else v
    return bool(v) if isinstance(v, (bool, np.bool_)) else v


def _write_json(path: str, value) -> None:
    # msprobe's own reader takes NaN and Infinity, as Python's json writes them
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
