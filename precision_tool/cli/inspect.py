"""The inspection commands: ls, ni, pt, cp, dc. Ops come from a run's compiled graph and a
step's index (read once); tensors are named by dump file or by op name."""
from __future__ import annotations

import os

import click
import numpy as np
from rich.markup import escape
from rich.table import Table

from ..analysis import ops
from ..analysis.comparing.pair import compare_pair
from ..dump import layout
from ..dump.layout import fit_file_name
from ..dump.workspace import WorkspaceError
from ..fileio import write_atomic, write_text_atomic
from .app import EXIT_FINDINGS, EXIT_OK, App, Finite, command, fmt, panel

RUN = click.option("-r", "--run", "run_spec", default=None, metavar="RUN",
                   help="npu/debug_0, cpu/debug_0, debug_0 or a run directory (default: the newest NPU run).")
STEP = click.option("-s", "--step", type=int, default=None, help="Dumped step (default: the first).")
STEP_LONG = click.option("--step", type=int, default=None, help="Dumped step (default: the first).")


# -- ls ---------------------------------------------------------------------------------------
@command("ls", "list", short_help="List ops by name, type, fusion pass or kernel.")
@click.option("-n", "--name", default=None, help="Op names containing this (literally).")
@click.option("-t", "--type", "op_type", default=None, help="Op types containing this.")
@click.option("-f", "--pass", "pass_name", default=None, help="Fused by a pass containing this.")
@click.option("-k", "--kernel", default=None, help="Kernel (unit_dtype, e.g. cube_float16) containing this.")
@RUN
def list_cmd(app: App, name, op_type, pass_name, kernel, run_spec):
    """List the ops of a run. Filters match substrings literally (no regex). With no filter,
    the runs (steps, size on disk, which run a replay reruns) and the counts of ops by type
    of each original run (of the run given with -r, a replay too)."""
    if not any((name, op_type, pass_name, kernel)):
        every = app.runs()
        runs = [app.run(run_spec, "npu")] if run_spec else [r for r in every if not r.info.get("replay_of")]
        listing = ops.run_listing(app.ws, every, runs)

        def render():
            t = Table(box=None, pad_edge=False)
            for col in ("run", "steps", "size", "replay of / values from"):
                t.add_column(col, justify="right" if col == "size" else "left")
            for r in listing.runs:
                t.add_row(r.run, layout.format_steps(r.steps) or "-",
                          f"{r.bytes / 2 ** 20:.1f} MiB",
                          r.replay_of or (f"values from {r.values_from}" if r.values_from else ""))
            app.console.print(t)
            replays = sum(1 for r in listing.runs if r.replay_of)
            if replays and not run_spec:
                app.line(f"{replays} replay run(s) (precision-tool clean deletes them; "
                         f"ls -r RUN counts one's ops)")
            for run, c in listing.counts.items():
                t = Table(box=None, pad_edge=False)
                t.add_column("op type")
                t.add_column("count", justify="right")
                for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])):
                    t.add_row(k, str(v))
                app.console.print(panel(t, title=f"{run}: {sum(c.values())} ops", title_align="left"))
        app.emit(listing, render)
        return EXIT_OK
    run = app.run(run_spec, "npu")
    found = ops.list_ops(app.ws, run, name, op_type, pass_name, kernel)

    def render():
        rows = [(f.name, f.type, f.kernel, f.pass_name) for f in found]
        columns = ("op", "type", "kernel", "pass")
        # an op name is copied: never broken, never cut. Where the columns do not fit side
        # by side (a narrow terminal), each op takes two lines instead of losing columns
        needed = sum(max([len(c)] + [len(r[k]) for r in rows]) + 2 for k, c in enumerate(columns))
        if needed > app.console.width:
            for r in rows:
                app.line(r[0])
                app.line("  " + "  ".join(f"{c} {v}" for c, v in zip(columns[1:], r[1:]) if v))
        else:
            t = Table(box=None, pad_edge=False)
            for col in columns:
                t.add_column(col, no_wrap=True)
            for r in rows:
                t.add_row(*r)
            app.console.print(t)
        app.console.print(f"{len(found)} op(s) in {run.target}/{run.name}")
    app.emit(found, render)
    return EXIT_OK


# -- ni ---------------------------------------------------------------------------------------
@command("ni", "node-info", short_help="An op: type, tensors, pass, dump files, golden files.")
@click.argument("name")
@click.option("-n", "--name", "name_flag", is_flag=True, help="(accepted for the reference tool's spelling)")
@click.option("-s", "--subgraph", "depth", type=click.IntRange(0, 20), default=None,
              help="Also export the subgraph within DEPTH hops as DOT (temp/op_graph/).")
@click.option("-a", "--all", "show_all", is_flag=True, help="Also the op's attributes.")
@RUN
@STEP_LONG
def node_info_cmd(app: App, name, name_flag, depth, show_all, run_spec, step):
    """Node info: the op's type, its inputs and outputs with dtype, format and shape, the pass
    that fused it and the ops it stands for, its dump files with statistics and the matching
    golden files. An inexact name lists the candidates."""
    run = app.run(run_spec, "npu")
    s = app.step(run, step) if run.complete_steps or step is not None else None
    golden = app.run(None, "cpu") if s is not None and app.ws.runs("cpu") else None
    info = ops.node_info(app.ws, run, name, s, golden, show_all, depth)
    note = info.note

    def render():
        lines = [f"type: {info.type}" + (f"   pass: {info.pass_name}" if info.pass_name else "")]
        if info.original_ops:
            lines.append("stands for: " + ", ".join(info.original_ops))
        if info.module:
            lines.append(f"module: {info.module}")
        if info.source:
            lines.append(f"source: {info.source}")
        lines.append("inputs:")
        lines += [f"  {i}" for i in info.inputs] or ["  -"]
        lines.append("outputs:")
        for k, o in enumerate(info.outputs):
            lines.append(f"  {k}: {o.get('dtype')} {o.get('format', '')} {o.get('shape')}")
        if note:
            lines.insert(0, note)
        app.console.print(panel(escape("\n".join(lines)), title=escape(info.name), title_align="left"))
        if info.dump:
            t = Table(box=None, pad_edge=False, title="dump", title_justify="left")
            # max, min and mean are over the finite elements: what is not finite is said beside
            for col in ("tensor", "dtype", "max", "min", "mean", "nan/inf", "file"):
                t.add_column(col, overflow="fold")
            for d in info.dump:
                t.add_row(f"{d['io']}{d['index']}", str(d["dtype"]), fmt(d.get("max"), 6),
                          fmt(d.get("min"), 6), fmt(d.get("mean"), 6), _nonfinite(d),
                          d.get("file") or "(stats only)")
            app.console.print(t)
        for g in info.golden:
            app.line(f"golden {g['tensor']}: {g['dtype']} [{g['shape']}] {g['file']}")
        if info.golden_note:
            app.line(f"golden: {info.golden_note}")
        if info.attrs is not None:
            app.console.print(f"attrs: {info.attrs}", markup=False)
        if info.dot_file:
            app.line(f"subgraph: {info.dot_file}")
    app.emit(info, render)
    return EXIT_OK


def _nonfinite(row: dict) -> str:
    """"186 +inf, 3 nan" from an index row's counts; "" where it holds none, "?" where the
    index does not say (a foreign dump without statistics)."""
    counts = [(row.get(key), label) for key, label in
              (("nan_count", "nan"), ("pos_inf_count", "+inf"), ("neg_inf_count", "-inf"))]
    if any(n is None or n != n for n, _ in counts):
        return "?"
    return ", ".join(f"{int(n)} {label}" for n, label in counts if n)


# -- pt ---------------------------------------------------------------------------------------
def _tensor(app: App, ref: str, run_spec, step, target: str = "npu") -> ops.Found:
    """ops.find_tensor in the command's workspace; the run it read named on stderr if a
    killed dump left steps of it partial."""
    try:
        ws = app.ws
    except WorkspaceError:          # none there: a file given by its path is still read
        from ..dump.workspace import Workspace
        ws = Workspace(app.ws_root())
    found = ops.find_tensor(ws, ref, run_spec, step, target)
    if found.run is not None:
        app.noting(found.run)
    return found


def _output_path(app: App, kind: str, ref: str, stem: str, suffix: str) -> str:
    """Where pt -c and dc write: the workspace's temp/<kind>/, or beside the file given when
    there is no workspace (a file compared on its own); the name within 255 bytes."""
    try:
        ws = app.ws
    except WorkspaceError:
        if not os.path.isfile(ref):
            raise
        directory = os.path.dirname(os.path.abspath(ref))
        os.makedirs(directory, exist_ok=True)
    else:
        directory = ws.results_dir("temp", kind)
    return os.path.join(directory, fit_file_name(stem, suffix))


@command("pt", "print-tensor", short_help="A tensor's summary and first values.")
@click.argument("ref", metavar="FILE|NAME")
@click.option("-n", "--name", "name_flag", is_flag=True, help="(accepted for the reference tool's spelling)")
@click.option("-c", "--copy", "copy", is_flag=True, help="Also write the values as text (temp/print_tensor/).")
@click.option("--head", type=click.IntRange(0), default=16, show_default=True, help="Values to show.")
@RUN
@STEP
def print_tensor_cmd(app: App, ref, name_flag, copy, head, run_spec, step):
    """Print a dumped tensor: shape, dtype, statistics and its first values. FILE|NAME is a dump
    file name or path, any .npy file, or a tensor as op:output:0 / op:input:1 / op (its first
    output). An NC1HWC0 tensor is shown as NCHW: its statistics leave the padding out."""
    found = _tensor(app, ref, run_spec, step)
    info = ops.tensor_summary(found, head)
    if copy:
        name = os.path.basename(found.row["file"] if found.row is not None else ref)
        path = _output_path(app, "print_tensor", ref, name, ".txt")
        flat = np.asarray(found.logical()).reshape(-1)
        write_text_atomic(path, "\n".join(repr(float(v)) for v in flat.astype(np.float64)) + "\n")
        info.copy = path

    def render():
        shape = f"shape {info.shape}  dtype {info.dtype}"
        if info.format == "NC1HWC0":
            shape += f"  (stored NC1HWC0 {info.stored_shape}: shown as NCHW, padding left out)"
        elif info.format:
            shape += f"  format {info.format}"
        lines = [shape] + ([info.saved_as] if info.saved_as else []) + [
                 f"max {fmt(info.max)}  min {fmt(info.min)}  mean {fmt(info.mean)}  "
                 f"l2norm {fmt(info.l2norm)}"
                 + ("  (over the finite elements)" if info.nonfinite else ""),
                 f"nan {info.nan_count}  +inf {info.pos_inf_count}  -inf {info.neg_inf_count}",
                 "head: " + (" ".join(fmt(v, 6) for v in info.head) or "(empty)")]
        app.console.print(panel(escape("\n".join(lines)), title=escape(found.label), title_align="left"))
        if info.copy:
            app.line(f"text copy: {info.copy}")
    app.emit(info, render)
    return EXIT_OK


# -- cp ---------------------------------------------------------------------------------------
def _golden_target(app: App, right_run) -> str:
    """RIGHT's run when it names no file: the one given with -rr, else the newest golden run;
    a workspace without one is an error (comparing the NPU tensor with itself says nothing)."""
    if right_run is None and not app.ws.runs("cpu"):
        raise WorkspaceError(f"the workspace {app.ws.root} has no golden run to compare with: "
                             f"dump one (cpu-dump), name RIGHT's run with -rr, or give a file")
    return "cpu"


@command("cp", "compare-pair", short_help="Two tensors side by side: errors, cosine, allclose.")
@click.argument("left", metavar="LEFT")
@click.argument("right", metavar="RIGHT")
@click.option("-p", "--print", "items", type=click.IntRange(0), default=10, show_default=True,
              help="Rows in the error-item and top-item tables.")
@click.option("-al", "--atol", type=Finite(0.0), default=1e-3, show_default=True,
              help="Absolute tolerance.")
@click.option("-rl", "--rtol", type=Finite(0.0), default=1e-3, show_default=True,
              help="Relative tolerance.")
@click.option("-s", "--summary", is_flag=True, help="The verdict lines only, no item tables.")
@click.option("-lr", "--left-run", default=None, metavar="RUN", help="Run of LEFT (default: newest NPU).")
@click.option("-rr", "--right-run", default=None, metavar="RUN", help="Run of RIGHT (default: newest golden).")
@STEP_LONG
def compare_pair_cmd(app: App, left, right, items, atol, rtol, summary, left_run, right_run, step):
    """Compare two tensors (dump files, tensor names, or any .npy files by path) element by
    element: the items out of tolerance, the largest errors, cosine similarity, allclose, and
    the error ratio with its formula. A nan or inf on one side only is out of tolerance; the
    same nan or inf on both sides is equal; the cosine and max |error| are taken over the
    finite pairs, as vc takes them. Tensors of different sizes are refused.

    Exit code 1 when allclose fails."""
    x = _tensor(app, left, left_run, step)
    y = _tensor(app, right, right_run, step, target="npu" if os.path.isfile(right) else
                _golden_target(app, right_run))
    a, b = x.logical(), y.logical()
    if a.size != b.size:
        raise WorkspaceError(f"cannot compare {x.label} ({a.size} elements, shape {list(a.shape)}) "
                             f"with {y.label} ({b.size} elements, shape {list(b.shape)}): sizes differ")
    result = compare_pair(a, b, atol, rtol, items, x.label, y.label)

    def table(title, rows, empty):
        # the title as a line of its own: a table's title wraps at the table's width
        app.console.print(title if rows else empty, markup=False)
        if not rows:
            return
        t = Table(box=None, pad_edge=False)
        for col in ("index", "left", "right", "|error|"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(str(r.index), fmt(r.left), fmt(r.right), fmt(r.abs_error))
        app.console.print(t)

    def render():
        if not summary:
            table(f"out of tolerance (first {items})", result.error_items,
                  "no element out of tolerance")
            table(f"largest finite errors (top {items})", result.top_items,
                  "no finite pair of elements to compare")
        lines = [f"{x.label}\n  vs {y.label}",
                 f"cosine {fmt(result.cosine)}   max |error| {fmt(result.max_abs_error)}"
                 + (f"   ({result.note})" if result.note else ""),
                 f"allclose(atol={atol}, rtol={rtol}): {result.allclose}",
                 f"error ratio {result.error_count}/{result.elements} = {fmt(result.error_ratio)}"
                 f"  where {result.formula}"]
        if result.nonfinite_mismatch or result.nonfinite_equal:
            lines.append(f"nan/inf: {result.nonfinite_mismatch} on one side only (errors), "
                         f"{result.nonfinite_equal} the same on both sides (equal)")
        app.console.print(panel(escape("\n".join(lines)), title="compare", title_align="left"))
    app.emit(result, render)
    return EXIT_OK if result.allclose else EXIT_FINDINGS


# -- dc ---------------------------------------------------------------------------------------


@command("dc", "convert", short_help="Convert an NPU dump (5HD) to NCHW or NHWC.")
@click.argument("ref", metavar="FILE|NAME")
@click.option("-n", "--name", "name_flag", is_flag=True, help="(accepted for the reference tool's spelling)")
@click.option("-f", "--format", "target", type=click.Choice(ops.LAYOUTS, case_sensitive=False), default="NCHW", show_default=True)
@RUN
@STEP
def convert_cmd(app: App, ref, name_flag, target, run_spec, step):
    """Convert a dumped NPU tensor from its device format (NC1HWC0) to NCHW or NHWC, written
    to temp/convert/<file>.<format>.npy."""
    found = _tensor(app, ref, run_spec, step)
    array, done = ops.convert_layout(found, target.upper())
    name = os.path.basename(found.row["file"] if found.row is not None else ref)
    done.file = _output_path(app, "convert", ref, name[:-4] if name.endswith(".npy") else name,
                             f".{done.target}.npy")
    write_atomic(done.file, lambda f: np.save(f, array, allow_pickle=False))
    app.emit(done, lambda: app.line(f"{done.tensor}: {done.source} -> {done.target} "
                                    f"{done.shape}\n{done.file}"))
    return EXIT_OK
