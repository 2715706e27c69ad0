"""A run's ops and tensors as the commands that list and show them see them (ls, ni, pt, cp,
dc): the runs of a workspace, every op with its kernel, an op found by name (or the fused op
that absorbed it) with its dumps, the subgraph around an op written as DOT, a tensor found by
file or tensor name, summarised or converted. The command line renders what these return;
its --json is their to_dict."""
from __future__ import annotations

import difflib
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ..dump import housekeeping
from ..dump.layout import fit_file_name, mangle
from ..dump.formats import BFLOAT16, read_tensor_file
from ..dump.workspace import Run, Workspace, WorkspaceError
from ..fileio import write_text_atomic
from ..graph import NodeView
from ..ops import registry
from .comparing.engine import logical_tensor
from .comparing.mapping import TensorMap


@dataclass(frozen=True)
class OpRow:
    """One op of a run: its name, type, kernel (compute unit and dtype, cube_float16...) and
    the fusion pass that made it, if one did."""
    name: str
    type: str
    kernel: str
    pass_name: str

    def to_dict(self) -> dict:
        return asdict(self)


def run_ops(ws: Workspace, run: Run) -> List[NodeView]:
    """The run's ops as its compiled graph holds them. A run without one (a golden run, a
    front-end's that compiles no graph) has them from the index of its first step: name,
    type, the tensors its input rows name and its output rows' dtype and shape."""
    graph = ws.compiled_graph(run)
    if graph:
        return list(graph)
    table = ws.index_table(run, ws.resolve_step(run, None))
    ops: Dict[str, NodeView] = {}
    for name, op_type, io, k, tensor, dtype, shape in zip(
            table["op_name"], table["op_type"], table["io"], table["index"], table["tensor"],
            table["dtype"], table["shape"]):
        node = ops.get(name)
        if node is None:
            node = ops[name] = NodeView(name, op_type, [], {}, [])
        side = node.inputs if io == "input" else node.outputs
        if int(k) == len(side):         # each index once, in order (a reader's rows repeat)
            side.append(tensor if io == "input" else
                        {"dtype": dtype, "shape": [int(d) for d in str(shape).split()]})
    return list(ops.values())


def kernel_of(node: NodeView) -> str:
    """The kernel a node runs: its compute unit and compute dtype (cube_float16...)."""
    try:
        unit = registry.get(node.type).unit
    except Exception:           # an op type this build does not know (a dump from elsewhere)
        unit = "?"
    return f"{unit}_{node.attrs.get('compute_dtype', '')}".rstrip("_")


def list_ops(ws: Workspace, run: Run, name: Optional[str] = None, op_type: Optional[str] = None,
             pass_name: Optional[str] = None, kernel: Optional[str] = None) -> List[OpRow]:
    """The run's ops whose name, type, pass and kernel contain the strings given (literally:
    no pattern), in graph order."""
    found = []
    for n in run_ops(ws, run):
        row = OpRow(n.name, n.type, kernel_of(n), n.attrs.get("pass_name", ""))
        if (name and name not in row.name) or (op_type and op_type not in row.type) or \
                (pass_name and pass_name not in row.pass_name) or \
                (kernel and kernel not in row.kernel):
            continue
        found.append(row)
    return found


def did_you_mean(name: str, names) -> str:
    """'; did you mean ...?' with the op names close to a mistyped one (whole names first,
    then by their last part: 'Softmx' finds 'encoder/layer_0/attention/Softmax'), or ''."""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.75)
    if not close:
        by_last: Dict[str, List[str]] = {}
        for full in names:
            by_last.setdefault(full.rpartition("/")[2], []).append(full)
        lasts = difflib.get_close_matches(name.rpartition("/")[2], list(by_last), n=3, cutoff=0.75)
        close = [full for last in lasts for full in by_last[last]][:3]
    return f"; did you mean {', '.join(close)}?" if close else ""


def find_op(ws: Workspace, run: Run, name: str) -> Tuple[NodeView, str]:
    """(node, note): the op of that exact name, or the fused op that absorbed it (the note
    says so and names the pass). A name that is only part of op names is never taken for
    one of them: WorkspaceError lists the candidates, or the names close to a mistyped one."""
    nodes = run_ops(ws, run)
    for n in nodes:
        if n.name == name:
            return n, ""
    for n in nodes:
        if name in n.attrs.get("original_op_names", []):
            return n, (f"{name} was fused into {n.name} ({n.type}) by "
                       f"{n.attrs.get('pass_name', 'a fusion pass')}: shown is that op")
    candidates = [n.name for n in nodes if name in n.name]
    if not candidates:
        raise WorkspaceError(f"no op {name!r} in {run.label}"
                             + did_you_mean(name, [n.name for n in nodes]))
    shown = ", ".join(candidates[:10]) + (f" ... ({len(candidates)} in all)" if len(candidates) > 10 else "")
    raise WorkspaceError(f"no op {name!r} in {run.label}; op(s) whose name holds it: {shown}")


def subgraph_dot(nodes: List[NodeView], center: str, depth: int) -> str:
    """The ops within `depth` hops of `center` (inputs and consumers alike) and the edges
    between them, as a DOT digraph; the center in bold."""
    by_name = {n.name: n for n in nodes}
    consumers: Dict[str, set] = {}
    for n in nodes:
        for i in n.inputs:
            consumers.setdefault(i.rsplit(":", 1)[0], set()).add(n.name)

    def inputs(name):
        return by_name[name].inputs if name in by_name else []
    keep, frontier = {center}, {center}
    for _ in range(depth):
        nxt = set()
        for name in frontier:
            nxt |= {i.rsplit(":", 1)[0] for i in inputs(name)}
            nxt |= consumers.get(name, set())
        frontier = nxt - keep
        keep |= nxt

    def q(text):             # a DOT string: backslash, quote and line break escaped
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    lines = ["digraph subgraph {", "  node [shape=box];"]
    for name in sorted(keep):
        op_type = by_name[name].type if name in by_name else "?"
        style = ', style=bold' if name == center else ""
        lines.append(f"  {q(name)} [label={q(name + chr(10) + op_type)}{style}];")
    for name in sorted(keep):
        for i in inputs(name):
            src = i.rsplit(":", 1)[0]
            if src in keep:
                lines.append(f"  {q(src)} -> {q(name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def export_subgraph(ws: Workspace, run: Run, center: str, depth: int) -> str:
    """subgraph_dot of the run's ops written to temp/op_graph/<op>_<depth>.dot (atomically,
    the name within 255 bytes); its path."""
    path = os.path.join(ws.results_dir("temp", "op_graph"),
                        fit_file_name(mangle(center), f"_{depth}.dot"))
    write_text_atomic(path, subgraph_dot(run_ops(ws, run), center, depth))
    return path


class Found(NamedTuple):
    """A tensor a command was named: its value as stored, a label, its index row (None for
    a file given by path), its dtype as the run holds it (the index's: bfloat16 is dumped as
    its float32 values), where the file's own header differs how it was saved, and the run
    it was read from (None for a file given by path)."""
    value: np.ndarray
    label: str
    row: object
    dtype: str
    saved_as: str
    run: Optional[Run] = None

    def logical(self) -> np.ndarray:
        """The value as NCHW where it is stored as NC1HWC0 (padding left out)."""
        if self.row is not None and self.row.get("format") == "NC1HWC0":
            return logical_tensor(self.value, "NC1HWC0", self.row["original_shape"])
        return self.value


def _from_path(path: str, value: np.ndarray) -> Found:
    # .npy has no name for bfloat16: such a file holds 2-byte raw values, read as bfloat16
    note = "saved as |V2 (2-byte raw values, which is how numpy saves ml_dtypes' bfloat16)" \
        if value.dtype == BFLOAT16 else ""
    return Found(value, path, None, str(value.dtype), note)


def find_tensor(ws: Workspace, ref: str, run_spec: Optional[str] = None,
                step: Optional[int] = None, target: str = "npu") -> Found:
    """The tensor a dump file name/path or a tensor name (op:output:0, op:0) names in the
    run (run_spec as Workspace.resolve_run takes it; step: the first dumped by default), or
    any .npy file given by its path (row None: no index row describes it). A path is read as
    dump files are (no unpickling) but need not lie in a workspace: the user named it. One
    outside the workspace is that file, whatever a dump file of the same name holds."""
    is_file = os.path.isfile(ref)
    root = os.path.realpath(ws.root) + os.sep
    if is_file and not os.path.realpath(ref).startswith(root):
        return _from_path(ref, read_tensor_file(ref))
    try:
        run = ws.resolve_run(run_spec, target)
    except WorkspaceError:
        if not is_file:
            raise
        return _from_path(ref, ws.load_file(ref))   # a file in a workspace without runs
    s = ws.resolve_step(run, step)
    table = ws.index(run, s)
    base = os.path.basename(ref)
    hit = table[table.file == base] if base.endswith(".npy") else table.iloc[0:0]
    if hit.empty:
        if ":" in ref and ref.rsplit(":", 2)[-2:][0] in ("input", "output"):
            op, io, k = ref.rsplit(":", 2)
            hit = table[(table.op_name == op) & (table.io == io) & (table["index"] == int(k))]
        else:
            op, _, k = ref.rpartition(":") if ref.rpartition(":")[2].isdigit() else (ref, "", "0")
            hit = table[(table.op_name == op) & (table.io == "output") & (table["index"] == int(k))]
    if hit.empty:
        if is_file:                    # in the workspace, outside the run's index
            return _from_path(ref, ws.load_file(ref))
        raise WorkspaceError(f"no dumped tensor {ref!r} in step {s} of {run.label}"
                             + did_you_mean(ref.split(":")[0], sorted(set(table.op_name))))
    row = hit.iloc[0]
    if not row["file"]:
        raise WorkspaceError(f"{ref} was dumped as statistics only: no tensor to print")
    value = ws.load(run, s, row["file"], row["shape"])
    dtype = str(row["dtype"])
    return Found(value, f"{run.label} {row['op_name']}:{row['io']}:{row['index']}", row, dtype,
                 f"stored as {value.dtype}" if dtype != str(value.dtype) else "", run)


# -- ls: the runs ------------------------------------------------------------------------------
@dataclass
class RunEntry:
    """A run as `ls` lists it: its label and kind (layout.DEVICE or REFERENCE), which run it
    replays or whose values it holds, its whole and partial steps, why its dump stopped,
    where it is and its size on disk."""
    run: str
    kind: str
    replay_of: Optional[str]
    values_from: Optional[str]
    steps: List[int]
    partial_steps: List[int]
    dump_stopped: Optional[dict]
    path: str
    bytes: int


@dataclass
class RunListing:
    """`ls` without a filter: every run, and the op counts by type of the runs counted."""
    runs: List[RunEntry]
    counts: Dict[str, Dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def run_listing(ws: Workspace, runs: List[Run], counted: List[Run]) -> RunListing:
    """The listing of `runs`, with the op counts (constants, variables and NoOps left out)
    of those of `counted` that dumped a step or compiled a graph."""
    counts = {r.label: dict(Counter(n.type for n in run_ops(ws, r)
                                    if n.type not in ("Const", "Variable", "NoOp")))
              for r in counted if r.steps or ws.compiled_graph(r)}
    entries = [RunEntry(r.label, r.kind, r.info.get("replay_of"), r.info.get("values_from"),
                        r.complete_steps, r.interrupted, r.info.get("dump_stopped"), r.path,
                        _size(r)) for r in runs]
    return RunListing(entries, counts)


def _size(run: Run) -> int:
    """The bytes a run holds: its directory's, and an imported run's steps where they are."""
    return housekeeping.size_of(run.path) + sum(
        housekeeping.size_of(s.path) for s in run.steps if run.info.get("source"))


# -- ni: an op -----------------------------------------------------------------------------------
@dataclass
class NodeInfo:
    """What `ni` shows of an op: its name (and the name asked, with a note where they
    differ), type, inputs, outputs' specs, the pass that fused it and the ops it stands
    for; the step's index rows of its tensors (dump) and the golden run's files of the
    tensors it stands for (golden, or golden_note saying why there are none); its
    attributes (asked with -a) and the DOT file of its subgraph (asked with -s)."""
    name: str
    asked: str
    note: str
    type: str
    inputs: List[str]
    outputs: List[dict]
    pass_name: str
    original_ops: List[str]
    step: Optional[int] = None
    dump: List[dict] = field(default_factory=list)
    golden: List[dict] = field(default_factory=list)
    golden_note: str = ""
    attrs: Optional[dict] = None
    dot_file: Optional[str] = None
    module: str = ""
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


_DUMP_COLUMNS = ["io", "index", "dtype", "shape", "file", "max", "min", "mean", "nan_count",
                 "pos_inf_count", "neg_inf_count"]


def node_info(ws: Workspace, run: Run, name: str, step: Optional[int] = None,
              golden: Optional[Run] = None, attrs: bool = False,
              depth: Optional[int] = None) -> NodeInfo:
    """The op `name` names in the run (find_op), with its dump rows at `step` (None: none
    asked, none read) and the golden run's files at the same step, its attributes when
    asked and its subgraph within `depth` hops written as DOT."""
    node, note = find_op(ws, run, name)
    a = node.attrs
    info = NodeInfo(node.name, name, note, node.type, list(node.inputs), list(node.outputs),
                    a.get("pass_name", ""), list(a.get("original_op_names", [])), step,
                    attrs=dict(a) if attrs else None)
    # where a front-end knows it: the module path and the script's line that made the call
    at = step if step is not None else (run.complete_steps or [None])[0]
    if at is not None:
        site = ws.call_sites(run, at).get(node.name, {})
        info.module, info.source = site.get("module", ""), site.get("source", "")
    if step is not None:
        table = ws.index(run, step)
        mine = table[table.op_name == node.name]
        info.dump = mine[[c for c in _DUMP_COLUMNS if c in mine]].to_dict("records")
        if golden is not None and step in golden.complete_steps:
            gt = ws.index(golden, step)
            tmap = TensorMap(ws.compiled_graph(run))
            wanted = {tmap.golden_tensor(f"{node.name}:{k}")
                      for k in range(len(info.outputs) or 1)}
            gt = gt[gt.tensor.isin(wanted) & (gt.io == "output")]
            info.golden = gt[["tensor", "dtype", "shape", "file"]].to_dict("records")
        elif golden is not None:
            info.golden_note = f"{golden.label} has no dump of step {step}"
    if depth is not None:
        info.dot_file = export_subgraph(ws, run, node.name, depth)
    return info


# -- pt and dc: a tensor -------------------------------------------------------------------------
@dataclass
class TensorSummary:
    """What `pt` shows of a tensor: its label, logical shape (NCHW for a 5HD tensor), dtype,
    device format and stored shape, how its file saved it where that differs, its
    statistics (kernels.tensor_stats: max, min, mean and l2norm over the finite elements,
    and the non-finite counts), its first values and where its text copy went (-c)."""
    tensor: str
    shape: List[int]
    dtype: str
    format: str
    stored_shape: List[int]
    saved_as: str
    max: float
    min: float
    mean: float
    l2norm: float
    nan_count: int
    pos_inf_count: int
    neg_inf_count: int
    head: List[float]
    copy: Optional[str] = None

    @property
    def nonfinite(self) -> int:
        return self.nan_count + self.pos_inf_count + self.neg_inf_count

    def to_dict(self) -> dict:
        return asdict(self)


def tensor_summary(found: Found, head: int) -> TensorSummary:
    """The tensor's summary with its first `head` values (as float64)."""
    from .. import kernels
    value = found.logical()
    flat = np.asarray(value).reshape(-1)
    fmt = found.row["format"] if found.row is not None and "format" in found.row else ""
    return TensorSummary(found.label, list(value.shape), found.dtype, fmt,
                         list(found.value.shape), found.saved_as,
                         head=flat[:head].astype(np.float64).tolist() if flat.size else [],
                         **kernels.tensor_stats(value))


LAYOUTS = ("NCHW", "NHWC")


@dataclass
class Conversion:
    """What `dc` did: the tensor, the format it was stored in (its JSON's "from"), the one
    written ("to"), the shape written and the file."""
    tensor: str
    source: str
    target: str
    shape: List[int]
    file: Optional[str] = None

    def to_dict(self) -> dict:
        return {"tensor": self.tensor, "from": self.source, "to": self.target,
                "shape": self.shape, "file": self.file}


def convert_layout(found: Found, layout: str) -> Tuple[np.ndarray, Conversion]:
    """A 5HD (or 4-D) tensor as NCHW or NHWC; refused in one line for any other."""
    if layout not in LAYOUTS:
        raise WorkspaceError(f"a tensor converts to {' or '.join(LAYOUTS)}, not {layout!r}")
    row = found.row
    source = row["format"] if row is not None and "format" in row else ""
    value = found.logical()
    if source != "NC1HWC0" and value.ndim != 4:
        raise WorkspaceError(f"{found.label} is {source or 'not 5HD'} with shape "
                             f"{list(value.shape)}: nothing to convert to {layout}")
    if layout == "NHWC":
        value = np.transpose(value, (0, 2, 3, 1))
    return np.ascontiguousarray(value), Conversion(found.label, source or "NCHW", layout,
                                                   list(value.shape))
