"""The analysis commands: ac, vc, vcs, fo. Each parses, calls precision_tool.analysis and
renders; --json prints the analysis result itself."""
from __future__ import annotations

import glob
import os
from typing import List

import click
import pandas as pd
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .. import analysis
from ..analysis.compare import COSINE_THRESHOLD, statistics_only
from ..analysis.mapping import check_compiled_graph
from ..dump.workspace import WorkspaceError
from .app import EXIT_FINDINGS, EXIT_OK, App, command, first_step, fmt

STEP = click.option("-s", "--step", type=int, default=None,
                    help="The dumped step (default: the first complete one).")
THRESHOLD = click.option("-c", "--cosine", "threshold", type=click.FloatRange(-1.0, 1.0),
                         default=COSINE_THRESHOLD, show_default=True,
                         help="Ops whose output cosine similarity is under this are reported.")


# -- ac ---------------------------------------------------------------------------------------
@command("ac", "auto-check", short_help="Auto check: fusion, overflow, and with -c the compare.")
@click.option("-c", "--compare", is_flag=True, help="Also compare every op with the golden run "
              "and find the root cause.")
@click.option("-l", "--limit", type=int, default=3, show_default=True,
              help="Overflows after the first, and ops under the threshold, to show.")
@click.option("-t", "--threshold", type=click.FloatRange(-1.0, 1.0), default=COSINE_THRESHOLD,
              show_default=True, help="Cosine threshold of the compare.")
@STEP
def auto_check_cmd(app: App, compare, limit, threshold, step):
    """Auto check: the fusion summary (passes and what they fused), the overflow analysis (the
    first overflow, then the next LIMIT, with decoded status and tensor statistics), and with
    -c the vector compare, the ops under the threshold and the root cause: the origin op,
    its fusion pass and its single-op replay. Ends with what to try next.

    Exit code 1 when something overflowed or an op is under the threshold."""
    npu = app.run(None, "npu")
    if compare:
        app.info("comparing every op with the golden run...")
    result = analysis.auto_check(app.ws, npu, step=step, compare=compare, threshold=threshold,
                                 limit=limit, write_csv=compare)
    app.emit(result.to_dict(), lambda: _render_ac(app, result, limit, threshold))
    return EXIT_FINDINGS if result.has_findings else EXIT_OK


def _render_ac(app: App, r, limit, threshold):
    out = app.console
    fusion = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    fusion.add_column("pass")
    fusion.add_column("fused nodes", justify="right")
    for name, count in sorted(r.fusion.items(), key=lambda kv: -kv[1]):
        fusion.add_row(name, str(count))
    out.print(Panel(fusion if r.fusion else "no fusion pass fired",
                    title=f"Fusion  {r.npu_run}, step {r.step}", title_align="left"))
    if r.overflows:
        lines = []
        shown = r.overflows[:limit + 1]
        for t in shown:
            mark = "first overflow" if r.first_overflow and t["op_name"] == r.first_overflow["op_name"] \
                else ("overflow" if t["inputs_finite"] else "carries an earlier overflow")
            lines.append(f"[bold]{escape(t['op_name'])}[/bold] ({t['op_type']}, task {t['task_id']}): {mark}")
            lines.append(f"  status {t['status']}: {', '.join(t['status_bits'])}")
            for x in t["tensors"]:
                bad = "".join(f" {k} {x[c]}" for k, c in (("nan", "nan_count"), ("inf", "inf_count")) if x[c])
                lines.append(f"  {x['io']} {x['index']}: {x['dtype']} \\[{x['shape']}] max {fmt(x['max'], 6)} "
                             f"min {fmt(x['min'], 6)} mean {fmt(x['mean'], 6)}{bad}")
        more = len(r.overflows) - len(shown)
        title = f"Overflow  {len(r.overflows)} overflowing task(s)" + (f", {more} more not shown" if more > 0 else "")
        out.print(Panel("\n".join(lines), title=title, title_align="left"))
    else:
        out.print(Panel("no overflow in this step", title="Overflow", title_align="left"))
    ls = r.loss_scale
    if ls and ls["first_scale"] == ls["first_scale"]:          # nan: no loss scaling
        moves = ", ".join(f"step {s}: {fmt(a)} -> {fmt(b)}" for s, a, b in ls["moves"][:limit]) or "none"
        out.print(Panel(f"{len(ls['overflow_steps'])} of {ls['steps']} observed steps overflowed; "
                        f"{len(ls['skipped_steps'])} updates skipped.\nscale {fmt(ls['first_scale'])} "
                        f"-> {fmt(ls['last_scale'])}; moves: {moves}",
                        title="Loss scale", title_align="left"))
    if r.golden_run is not None:
        if r.under_threshold:
            for s in r.under_threshold:
                _render_op(app, s)
        else:
            out.print(Panel(f"every op's output cosine is at or above {fmt(threshold)}",
                            title="Compare", title_align="left"))
        if r.origin:
            o = r.origin
            fused = f"fused by {o['pass_name']}" if o["pass_name"] else "not fused"
            out.print(Panel(f"{o['op_name']} ({o['op_type']}, {fused})\nits inputs match the golden, "
                            f"its outputs do not: {', '.join(o['bad_outputs'])}\n"
                            f"single-op replay: {r.origin_replay}",
                            title="Root cause", title_align="left"))
        if r.result_file:
            app.info(f"compare result: {r.result_file}")
    out.print(Panel(r.advice, title="Next", title_align="left"))


def _render_op(app: App, s: dict):
    role = s["role"] or s["category"]
    if s["category"] == "nan" and s["role"]:
        role += ", nan"
    lines = [f"golden ops: {', '.join(s['golden_ops']) or '-'}"]
    if s["pass_name"]:
        lines.append(f"pass: {s['pass_name']}")
    if s["statistics_only"]:    # no tensors dumped: how far apart the norms are instead
        lines.append("statistics only: relative differences of the norms")
        lines.append("inputs:  " + (" ".join(fmt(c) for c in s["input_norm_diffs"]) or "-"))
        lines.append("outputs: " + " ".join(fmt(c) for c in s["output_norm_diffs"]))
    else:
        lines.append("input cosines:  " + (" ".join(fmt(c) for c in s["input_cosines"]) or "-"))
        lines.append("output cosines: " + " ".join(fmt(c) for c in s["output_cosines"]))
    app.console.print(Panel(escape("\n".join(lines)), title=escape(f"{s['op_name']} ({s['op_type']})  [{role}]"),
                            title_align="left"))


# -- vc ---------------------------------------------------------------------------------------
@command("vc", "vector-compare", short_help="Compare every op of a step with the golden run.")
@click.option("-lt", "--left", default=None, metavar="RUN",
              help="The run to check: npu/debug_0, debug_0 or its directory (default: the "
                   "newest NPU run). Another NPU run compares fusion on against off.")
@click.option("-rt", "--right", default=None, metavar="RUN",
              help="The reference run (default: the newest golden run).")
@click.option("-g", "--graph", "graph_file", default=None, metavar="GRAPH",
              type=click.Path(dir_okay=False),
              help="The compiled graph JSON to map tensors with (default: the run's graph/).")
@click.option("-w", "--workers", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Local worker processes comparing tensor pairs in parallel.")
@click.option("--scheduler", default=None, metavar="ADDRESS",
              help="Run the comparisons on this Dask cluster (tcp://host:8786); the workers "
                   "read the dump from storage shared with this machine. Needs "
                   "pip install \"precision_tool[cluster]\".")
@STEP
@THRESHOLD
def vector_compare_cmd(app: App, left, right, graph_file, workers, scheduler, step, threshold):
    """Vector compare: map every dumped NPU tensor to its golden tensor (through fused ops,
    inserted Cast/TransData and 5HD), compute the metrics, write
    temp/vector_compare/<ts>/result_<ts>.csv and print the counts. A step dumped as
    statistics only is compared by its norms.

    Exit code 1 when an op's output falls under the threshold."""
    npu = app.run(left, "npu")
    golden = app.run(right, "cpu")
    step = first_step(npu, step)
    graph = None
    if graph_file is not None:
        from ..fileio import load_json
        graph = check_compiled_graph(load_json(graph_file, WorkspaceError, "compiled graph"))
    with Progress(TextColumn("comparing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=app.err, transient=True, disable=app.as_json or app.log_level > 1) as bar:
        task = bar.add_task("compare", total=None)
        table = analysis.vector_compare(app.ws, npu, golden, step, threshold=threshold, graph=graph,
                                        progress=lambda k, n: bar.update(task, completed=k, total=n),
                                        workers=workers, scheduler=scheduler)
    path = analysis.write_result(app.ws, table)
    under = analysis.count_findings(table, threshold)
    counts = table.Verdict.value_counts().to_dict()
    payload = {"result_file": path, "npu_run": f"{npu.target}/{npu.name}",
               "golden_run": f"{golden.target}/{golden.name}", "step": step, "rows": len(table),
               "verdicts": counts, "ops_under_threshold": under}

    def render():
        parts = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        app.console.print(f"{npu.target}/{npu.name} against {golden.target}/{golden.name}, step {step}: "
                          f"{len(table)} tensors ({parts}); {under} op(s) under {fmt(threshold)}")
        app.line(f"result: {path}")
        if under:
            app.console.print("summary: precision-tool vcs" + ("" if threshold == COSINE_THRESHOLD
                                                               else f" -c {threshold}"))
    app.emit(payload, render)
    return EXIT_FINDINGS if under else EXIT_OK


# -- vcs --------------------------------------------------------------------------------------
@command("vcs", "vector-summary", short_help="Ops under the cosine threshold, origin first.")
@click.option("-f", "--file", "files", multiple=True, metavar="CSV",
              help="Result file(s) of vc (default: the newest; without one, vc runs first).")
@THRESHOLD
@click.option("-l", "--limit", type=int, default=3, show_default=True,
              help="Ops to show per file (0: all).")
@click.option("--by-cosine", is_flag=True, help="Worst cosine first instead of execution order.")
def vector_summary_cmd(app: App, files, threshold, limit, by_cosine):
    """Summary of a vector compare: the ops whose output cosine is under the threshold (and
    those whose output became nan/inf, always), in execution order (the origin of a
    divergence comes first) or by cosine, each with its golden ops, its fusion pass and its
    input and output cosines. Cancellation noise (an exact result of zero) is shown last.

    Exit code 1 when an op is under the threshold; 0 when none is."""
    paths = list(files) or _newest_results(app)
    if not paths:
        app.info("no compare result yet: running vc first")
        npu, golden = app.run(None, "npu"), app.run(None, "cpu")
        table = analysis.vector_compare(app.ws, npu, golden, first_step(npu, None))
        paths = [analysis.write_result(app.ws, table)]
    reports = []
    for path in paths:
        table = _read_result(path)
        cause = analysis.root_cause(table, threshold)
        ops = analysis.summarize(table, threshold, limit=limit, by_cosine=by_cosine, cause=cause,
                                 noise_last=True)
        origin = cause.first_origin
        reasons = table["CompareFailReason"].tolist() if "CompareFailReason" in table else []
        reports.append({"file": path, "threshold": threshold,
                        "statistics_only": bool(reasons) and all(statistics_only(reasons)),
                        "under_threshold": analysis.count_findings(table, threshold, cause),
                        "origin": origin.op_name if origin else None,
                        "ops": [vars(s) for s in ops]})

    def render():
        for rep in reports:
            app.line(rep["file"])           # a line of its own: long, and copied whole
            app.line(f"{rep['under_threshold']} op(s) under {fmt(threshold)}"
                     + (f" (statistics only: norms apart by more than {fmt(1 - threshold)})"
                        if rep["statistics_only"] else "")
                     + (f", origin {rep['origin']}" if rep["origin"] else ""))
            for s in rep["ops"]:
                _render_op(app, s)
    app.emit(reports if len(reports) > 1 else reports[0], render)
    return EXIT_FINDINGS if any(r["under_threshold"] for r in reports) else EXIT_OK


def _newest_results(app: App) -> List[str]:
    found = glob.glob(os.path.join(app.ws.root, "temp", "vector_compare", "*", "result_*.csv"))
    return [max(found, key=os.path.getmtime)] if found else []


# what the summary and the root cause read of a result table
SUMMARY_COLUMNS = frozenset({"Index", "OpType", "NPUDump", "NpuDataType", "GroundTruth",
                             "TensorIndex", "PassName", "GoldenTensor", "CosineSimilarity",
                             "MaxAbsoluteError", "NpuNanCount", "NpuInfCount", "GoldenNanCount",
                             "GoldenInfCount", "NpuNorm", "GoldenNorm", "NormRelativeDiff",
                             "CompareFailReason", "Verdict"})


def _read_result(path: str) -> pd.DataFrame:
    try:
        table = pd.read_csv(path, keep_default_na=False, na_values=["nan", "NaN", ""],
                            usecols=lambda c: c in SUMMARY_COLUMNS,     # a third of them
                            dtype={"NPUDump": str, "TensorIndex": str, "GoldenTensor": str,
                                   "PassName": str, "GroundTruth": str, "CompareFailReason": str})
    except FileNotFoundError:
        raise WorkspaceError(f"no result file {path}") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as e:
        raise WorkspaceError(f"{path} is not a readable compare result: {e}") from None
    missing = {"NPUDump", "OpType", "TensorIndex", "CosineSimilarity", "Verdict", "Index"} - set(table.columns)
    if missing:
        raise WorkspaceError(f"{path} is not a compare result of precision-tool vc: no "
                             f"{', '.join(sorted(missing))} column")
    for col in ("PassName", "GroundTruth", "GoldenTensor", "CompareFailReason"):
        if col in table:
            table[col] = table[col].fillna("")
    return table


# -- fo ---------------------------------------------------------------------------------------
@command("fo", "fusion-off", short_help="Replay a step with fusion off; bisect the passes.")
@STEP
@THRESHOLD
def fusion_off_cmd(app: App, step, threshold):
    """Replay the dumped step from its bundle with every fusion pass off (into the next
    npu/debug_<k>), compare both runs with the golden run and say whether fusion is to blame;
    if it is, bisect over the passes that fired to name the pass(es) and their fused nodes.

    Exit code 1 when fusion is to blame."""
    npu, golden = app.run(None, "npu"), app.run(None, "cpu")
    step = first_step(npu, step)
    app.info(f"replaying step {step} of {npu.target}/{npu.name} with fusion off, then bisecting...")
    verdict = analysis.bisect_fusion(app.ws, npu, golden, step, threshold)
    app.refresh()

    def render():
        if not verdict.fusion_to_blame:
            body = (f"Fusion is not to blame: with every pass off, the same tensors diverge.\n"
                    f"passes that fired: {', '.join(verdict.fired) or 'none'}")
        else:
            body = "\n".join([f"Fusion is to blame: {len(verdict.new_failures)} tensor(s) diverge "
                              f"only with fusion on."] +
                             [f"{p}: {', '.join(verdict.fused_nodes.get(p, []))}" for p in verdict.culprits])
        body += f"\nreplays: {verdict.replays} ({', '.join(verdict.runs)})"
        app.console.print(Panel(body, title="Fusion-off replay", title_align="left"))
    app.emit(verdict, render)
    return EXIT_FINDINGS if verdict.fusion_to_blame else EXIT_OK
