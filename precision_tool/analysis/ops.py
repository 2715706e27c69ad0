"""A run's ops as the commands that list and show them see them (ls, ni): every op with its
kernel, an op found by name (or the fused op that absorbed it), and the subgraph around an
op written as DOT. The command line renders what these return."""
from __future__ import annotations

import difflib
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from ..dump.layout import fit_file_name, mangle
from ..dump.workspace import Run, Workspace, WorkspaceError
from ..fileio import write_text_atomic
from ..ops import registry


@dataclass(frozen=True)
class OpRow:
    """One op of a run: its name, type, kernel (compute unit and dtype, cube_float16...) and
    the fusion pass that made it, if one did."""
    name: str
    type: str
    kernel: str
    pass_name: str

    def to_json(self) -> dict:
        return asdict(self)


def run_ops(ws: Workspace, run: Run) -> List[dict]:
    """The run's ops as its compiled graph holds them (JSON nodes); a golden run has no
    compiled graph: its ops, name and type only, come from the index of its first step."""
    graph = ws.graph_json(run)
    if graph:
        return graph.get("nodes", [])
    table = ws.index(run, ws.resolve_step(run, None))
    return [{"name": n, "type": t, "attrs": {}} for n, t in
            table[["op_name", "op_type"]].drop_duplicates().itertuples(index=False)]


def kernel_of(node: dict) -> str:
    """The kernel a node runs: its compute unit and compute dtype (cube_float16...)."""
    try:
        unit = registry.get(node["type"]).unit
    except Exception:           # an op type this build does not know (a dump from elsewhere)
        unit = "?"
    return f"{unit}_{node.get('attrs', {}).get('compute_dtype', '')}".rstrip("_")


def list_ops(ws: Workspace, run: Run, name: Optional[str] = None, op_type: Optional[str] = None,
             pass_name: Optional[str] = None, kernel: Optional[str] = None) -> List[OpRow]:
    """The run's ops whose name, type, pass and kernel contain the strings given (literally:
    no pattern), in graph order."""
    found = []
    for n in run_ops(ws, run):
        row = OpRow(n["name"], n["type"], kernel_of(n), n.get("attrs", {}).get("pass_name", ""))
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


def find_op(ws: Workspace, run: Run, name: str) -> Tuple[dict, str]:
    """(node, note): the op of that exact name, or the fused op that absorbed it (the note
    says so and names the pass). A name that is only part of op names is never taken for
    one of them: WorkspaceError lists the candidates, or the names close to a mistyped one."""
    nodes = run_ops(ws, run)
    for n in nodes:
        if n["name"] == name:
            return n, ""
    for n in nodes:
        attrs = n.get("attrs", {})
        if name in attrs.get("original_op_names", []):
            return n, (f"{name} was fused into {n['name']} ({n['type']}) by "
                       f"{attrs.get('pass_name', 'a fusion pass')}: shown is that op")
    candidates = [n["name"] for n in nodes if name in n["name"]]
    if not candidates:
        raise WorkspaceError(f"no op {name!r} in {run.label}"
                             + did_you_mean(name, [n["name"] for n in nodes]))
    shown = ", ".join(candidates[:10]) + (f" ... ({len(candidates)} in all)" if len(candidates) > 10 else "")
    raise WorkspaceError(f"no op {name!r} in {run.label}; op(s) whose name holds it: {shown}")


def subgraph_dot(nodes: List[dict], center: str, depth: int) -> str:
    """The ops within `depth` hops of `center` (inputs and consumers alike) and the edges
    between them, as a DOT digraph; the center in bold."""
    by_name = {n["name"]: n for n in nodes}
    consumers: Dict[str, set] = {}
    for n in nodes:
        for i in n.get("inputs", []):
            consumers.setdefault(i.rsplit(":", 1)[0], set()).add(n["name"])
    keep, frontier = {center}, {center}
    for _ in range(depth):
        nxt = set()
        for name in frontier:
            nxt |= {i.rsplit(":", 1)[0] for i in by_name.get(name, {}).get("inputs", [])}
            nxt |= consumers.get(name, set())
        frontier = nxt - keep
        keep |= nxt

    def q(text):             # a DOT string: backslash, quote and line break escaped
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    lines = ["digraph subgraph {", "  node [shape=box];"]
    for name in sorted(keep):
        n = by_name.get(name, {"type": "?"})
        style = ', style=bold' if name == center else ""
        lines.append(f"  {q(name)} [label={q(name + chr(10) + n['type'])}{style}];")
    for name in sorted(keep):
        for i in by_name.get(name, {}).get("inputs", []):
            src = i.rsplit(":", 1)[0]
            if src in keep:
                lines.append(f"  {q(src)} -> {q(name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def export_subgraph(ws: Workspace, run: Run, center: str, depth: int) -> str:
    """subgraph_dot of the run's ops written to temp/op_graph/<op>_<depth>.dot (atomically,
    the name within 255 bytes); its path."""
    path = os.path.join(ws.root, "temp", "op_graph", fit_file_name(mangle(center), f"_{depth}.dot"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text_atomic(path, subgraph_dot(run_ops(ws, run), center, depth))
    return path
