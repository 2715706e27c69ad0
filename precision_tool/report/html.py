"""One self-contained HTML file: styles, a few lines of script and the plots inline (static
SVG drawn here: no plotting library to ship, a few hundred bytes per point, and every point
carries its own tooltip). Everything shown comes from the analysis library's results: the
auto check (`ac -c --json`), its compare result CSV, the root cause of that result, the
loss-scale history, the watchpoints and the repair's config/fix.json."""
from __future__ import annotations

import html
import json
import math
import os
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..analysis import Coverage, auto_check, read_result, root_cause, vector_compare
from ..analysis.comparing.verdicts import DIVERGING, Criteria
from ..dump import Workspace, load_bundle
from ..dump.workspace import Run
from ..errors import PrecisionToolError
from ..fileio import write_text_atomic
from ..table import column, numbers, texts

# a point's colour is its op's role in the root cause: red and orange for the findings only;
# a divergence the verdict calls harmless (cancellation noise, no effect on any output, a
# gradual crossing) is grey
ROLE_COLOURS = {"origin": "#d62728", "propagator": "#ff7f0e", "carried": "#9467bd",
                "cancellation": "#b0b0b0", "no-effect": "#7f7f7f", "gradual": "#999999",
                "pass": "#1f77b4", "error": "#444444"}
FINDING_ROLES = ("origin", "propagator", "carried")


class ReportError(PrecisionToolError, ValueError):
    """A report that cannot be made (no golden run to compare with...)."""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _scope(op_name: str, depth: int = 2) -> str:
    parts = op_name.split("/")
    parts = parts[1:] if parts[0] == "gradients" and len(parts) > 1 else parts
    return "/".join(parts[:depth]) if len(parts) > 1 else "(top)"


# -- the data ---------------------------------------------------------------------------------
def _ops(table, criteria: Criteria) -> List[dict]:
    """One point per output row of the compare, in execution order."""
    cause = root_cause(table, criteria)
    roles = {d.op_name: "origin" for d in cause.origins}
    roles.update({d.op_name: "propagator" for d in cause.propagators})
    roles.update({d.op_name: "cancellation" for d in cause.cancellations})
    roles.update({d.op_name: "carried" for d in cause.carried})
    roles.update({d.op_name: "no-effect" for d in cause.no_effect})
    roles.update({d.op_name: "gradual" for d in cause.gradual})
    rows = cause.rows                  # the verdicts the root cause was judged on
    at = np.flatnonzero(np.array(rows.is_out))
    at = at[np.argsort(column(table, "Index", 0)[at], kind="stable")]   # execution order
    reasons = dict(zip(at.tolist(), rows.reasons(at.tolist())))
    op = texts(table, "NPUDump")
    golden_dtype = texts(table, "GoldenDataType")
    norm = numbers(table, "NormRelativeDiff")
    points = []
    for i, pos in enumerate(at.tolist()):
        verdict = rows.verdict[pos]
        # an op's role colours its diverging outputs only: an output that matches is a pass
        role = roles.get(op[pos], "pass") if verdict in DIVERGING else \
            "error" if verdict == "error" else "pass"
        points.append({"x": i, "op": op[pos], "type": rows.op_type[pos], "tensor": rows.tensor[pos],
                       "pass": rows.pass_name[pos] or "", "dtype": rows.dtype[pos],
                       "golden_dtype": golden_dtype[pos], "cosine": float(rows.cosine[pos]),
                       "norm": float(norm[pos]), "verdict": verdict,
                       "reason": reasons[pos] or "", "role": role, "scope": _scope(op[pos])})
    return points


def _losses(ws: Workspace, run: Run) -> Dict[int, float]:
    """The loss of each dumped step that has a replay bundle (its first fetched tensor)."""
    out = {}
    for step in run.complete_steps:
        if step not in run.bundles:
            continue
        try:
            name = load_bundle(ws.bundle_path(run, step)).meta["fetch_tensors"][0]
            index = ws.index(run, step)
        except (PrecisionToolError, IndexError, KeyError):
            continue
        rows = index[(index.tensor == name) & (index.io == "output")]
        if len(rows):
            out[step] = float(rows["max"].iloc[0])
    return out


def _heatmap(ws: Workspace, npu: Run, golden: Run, criteria: Criteria, limit: int):
    """Per layer (scope) and dumped step, the worst finite output cosine and what the verdict
    makes of the scope there: "finding" (an op of it is an origin, propagator or carried
    state), "harmless" (its ops diverge without being a finding: cancellation noise, no
    effect) or "pass": (steps, scopes, cosines, kinds), or None with fewer than two steps
    dumped on both sides."""
    steps = [s for s in npu.complete_steps if s in golden.complete_steps][:limit]
    if len(steps) < 2:
        return None
    cells: Dict[str, Dict[int, float]] = defaultdict(dict)
    kinds: Dict[str, Dict[int, str]] = defaultdict(dict)
    rank = {"pass": 0, "harmless": 1, "finding": 2}
    for s in steps:
        table = vector_compare(ws, npu, golden, s, threshold=criteria)
        cause = root_cause(table, criteria)
        findings = {d.op_name for d in cause.origins + cause.propagators + cause.carried}
        benign = cause.benign_ops
        out = table[table.TensorIndex.astype(str).str.contains(":output:")]
        for name, cos in zip(out.NPUDump.astype(str), out.CosineSimilarity.astype(float)):
            scope = _scope(name)
            kind = "finding" if name in findings else "harmless" if name in benign else "pass"
            if rank[kind] >= rank[kinds[scope].get(s, "pass")]:
                kinds[scope][s] = kind
            if math.isfinite(cos):
                cells[scope][s] = min(cells[scope].get(s, 1.0), cos)
    scopes = sorted(set(cells) | set(kinds))
    return (steps, scopes, [[cells[sc].get(s, math.nan) for s in steps] for sc in scopes],
            [[kinds[sc].get(s, "pass") for s in steps] for sc in scopes])


# -- drawing ----------------------------------------------------------------------------------
W, H, PAD = 960, 240, 48


def _log_y(v: float, lo: float, hi: float) -> float:
    v = min(max(v, lo), hi)
    return PAD / 2 + (H - PAD) * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))


def _scatter(points: List[dict], key: str, label: str, lo: float, hi: float,
             marks: Dict[str, str], origin_op: Optional[str] = None) -> str:
    """Points of error = key(point) on a log axis along execution order; marks: op -> what
    to draw a vertical line for (origin, first overflow)."""
    n = max(len(points), 1)
    x_of = lambda i: PAD + (W - 2 * PAD) * (i / max(n - 1, 1))  # noqa: E731
    parts = [f'<svg class="plot" data-plot="{key}" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
             f'<text x="6" y="14" class="axis">{_e(label)} (log)</text>']
    for exp in range(int(math.log10(lo)), int(math.log10(hi)) + 1):
        y = _log_y(10.0 ** exp, lo, hi)
        parts.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="4" y="{y + 4:.1f}" class="axis">1e{exp}</text>')
    for p in points:
        if p["op"] in marks and p["tensor"].endswith(":output:0"):
            x = x_of(p["x"])
            kind = marks[p["op"]].split(",")[0]
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD / 2}" y2="{H - PAD / 2}" '
                         f'class="mark {kind}" data-op="{_e(p["op"])}"/><text x="{x + 3:.1f}" '
                         f'y="{PAD / 2 + 10}" class="marklabel">{_e(marks[p["op"]])}: '
                         f'{_e(p["op"])}</text>')
    for p in points:
        value = p[key]
        if not math.isfinite(value):
            continue
        err = abs(value) if key == "norm" else max(1.0 - value, 0.0)
        first_origin = p["op"] == origin_op
        r = 6 if first_origin else 4 if p["role"] == "origin" else 3
        title = (f'{p["op"]} ({p["type"]}) {p["tensor"]}\npass: {p["pass"] or "-"}; dtype '
                 f'{p["dtype"]} vs {p["golden_dtype"]}\ncosine {p["cosine"]:.8f}; norm '
                 f'{p["norm"]:+.4g}\n{p["verdict"]}{": " + p["reason"] if p["reason"] else ""}')
        parts.append(f'<circle cx="{x_of(p["x"]):.1f}" cy="{_log_y(max(err, lo), lo, hi):.1f}" r="{r}" '
                     f'fill="{ROLE_COLOURS[p["role"]]}" class="pt {p["role"]}'
                     f'{" first-origin" if first_origin else ""}" data-op="{_e(p["op"])}" '
                     f'data-tensor="{_e(p["tensor"])}" data-scope="{_e(p["scope"])}">'
                     f'<title>{_e(title)}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def _bars(steps: int, marked: Sequence[int], label: str, cls: str) -> str:
    if not marked:                                       # nothing to draw: said, not drawn
        return f'<p class="{cls}-none">{_e(label.split(" (")[0])}: none of the {steps} step(s)</p>'
    n, left = max(steps, 1), 130                         # the label's room on the left
    w = (W - left - PAD) / n
    body = "".join(f'<rect x="{left + s * w:.1f}" y="20" width="{max(w - 1, 1):.1f}" height="20" '
                   f'class="{cls}"><title>step {s}</title></rect>' for s in marked)
    return (f'<svg width="{W}" height="50" class="bars" data-plot="{cls}"><text x="4" y="34" '
            f'class="axis">{_e(label)}</text>{body}</svg>')


def _line(values: Dict[int, float], label: str, cls: str) -> str:
    pts = sorted((s, v) for s, v in values.items() if v is not None and math.isfinite(v))
    if not pts:
        return f"<p>no {_e(label)} recorded</p>"
    if len(pts) == 1:                                    # one value is a sentence, not a plot
        return f"<p>{_e(label)}: {pts[0][1]:.6g} (step {pts[0][0]})</p>"
    lo, hi = min(v for _, v in pts), max(v for _, v in pts)
    span, last = (hi - lo) or 1.0, max(s for s, _ in pts) or 1
    xy = [(PAD + (W - 2 * PAD) * s / last, 20 + (120 - 30) * (1 - (v - lo) / span)) for s, v in pts]
    circles = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" class="{cls}"><title>step {s}: '
                      f'{v:.6g}</title></circle>' for (x, y), (s, v) in zip(xy, pts))
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    return (f'<svg width="{W}" height="130" data-plot="{cls}"><text x="4" y="14" class="axis">'
            f'{_e(label)}: {lo:.6g} .. {hi:.6g}</text><polyline points="{path}" class="{cls}"/>'
            f"{circles}</svg>")


def _heat(grid) -> str:
    steps, scopes, matrix, kinds = grid
    rows = []
    for scope, row, kind_row in zip(scopes, matrix, kinds):
        cells = []
        for s, c, kind in zip(steps, row, kind_row):
            back, fore = _heat_colours(c, kind)
            text = f"{c:.4f}" if math.isfinite(c) else "-"
            cells.append(f'<td class="cell {kind}" style="background:{back};color:{fore}" '
                         f'title="{_e(scope)}, step {s}: {_e(HEAT_KINDS[kind])}; worst cosine '
                         f'{c:.8f}">{text}</td>')
        rows.append(f"<tr><th>{_e(scope)}</th>{''.join(cells)}</tr>")
    head = "".join(f"<th>step {s}</th>" for s in steps)
    legend = " ".join(f"<span class='cell {k}' style='background:{_heat_colours(0.9, k)[0]};"
                      f"color:{_heat_colours(0.9, k)[1]}'>{_e(v)}</span>"
                      for k, v in HEAT_KINDS.items())
    return (f'<p class="legend">{legend}; the number: the worst output cosine</p>'
            f'<table class="heatmap"><tr><th>layer</th>{head}</tr>{"".join(rows)}</table>')


HEAT_KINDS = {"finding": "a finding", "harmless": "diverges without effect",
              "pass": "matches"}


def _heat_colours(cos: float, kind: str) -> tuple:
    """(background, text) of a heatmap cell: red only for a finding, darker the lower its
    cosine (0.9 and below: darkest); grey for a divergence the verdict calls harmless; white
    where it matches. The text is whichever of near-black and white contrasts more (WCAG's
    ratio stays above 4.5 on every background drawn)."""
    if kind == "finding":
        bad = min(max((1.0 - cos) / 0.1, 0.0), 1.0) if math.isfinite(cos) else 1.0
        light, dark = (252, 187, 161), (165, 15, 21)
        rgb = tuple(round(a + (b - a) * bad) for a, b in zip(light, dark))
    elif kind == "harmless":
        rgb = (224, 224, 224)
    else:
        rgb = (255, 255, 255)
    fore = "#ffffff" if _contrast(rgb, (255, 255, 255)) > _contrast(rgb, (34, 34, 34)) else "#222222"
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})", fore


def _contrast(a, b) -> float:
    """WCAG 2's contrast ratio of two sRGB colours (1 to 21)."""
    def lum(rgb):
        c = [v / 255 for v in rgb]
        c = [v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4 for v in c]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _table(rows: List[dict], columns: Sequence[str], cls: str = "sortable") -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_e(r.get(c, ''))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


STYLE = """body{font-family:sans-serif;margin:24px;color:#222}h2{border-bottom:1px solid #ccc}
.plot,.bars{border:1px solid #ddd;margin:4px 0}.grid{stroke:#eee}.axis{font-size:11px;fill:#666}
.mark{stroke-dasharray:4 3;stroke-width:1.5}.first-origin{stroke:#000;stroke-width:1.5}.mark.origin{stroke:#d62728}
.mark.first-overflow{stroke:#2ca02c}.marklabel{font-size:11px}.pt:hover{stroke:#000}
.overflow{fill:#d62728}.skipped{fill:#ff7f0e}polyline{stroke-width:1.5}
polyline.loss{stroke:#1f77b4;fill:none}circle.loss{stroke:#1f77b4;fill:#1f77b4}
polyline.scale{stroke:#9467bd;fill:none}circle.scale{stroke:#9467bd;fill:#9467bd}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:2px 6px;font-size:13px}
th{background:#f4f4f4;cursor:pointer}pre{background:#f8f8f8;padding:8px;white-space:pre-wrap}
.verdict{font-size:18px;font-weight:bold}.unseen{color:#b00;font-weight:bold}.cell{text-align:right}
span.cell{padding:1px 6px;border:1px solid #ddd}"""

SCRIPT = r"""document.querySelectorAll('table.sortable th').forEach(function(th,i){
 th.addEventListener('click',function(){var t=th.closest('table'),b=t.tBodies[0];
  var rows=Array.prototype.slice.call(b.rows),asc=th.dataset.asc!=='1';th.dataset.asc=asc?'1':'0';
  rows.sort(function(a,c){var x=a.cells[i].textContent,y=c.cells[i].textContent,
   nx=parseFloat(x),ny=parseFloat(y),d=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);
   return asc?d:-d;});rows.forEach(function(r){b.appendChild(r);});});});
var sel=document.getElementById('scope');
if(sel){sel.addEventListener('change',function(){var v=sel.value;
 document.querySelectorAll('circle.pt').forEach(function(c){
  c.style.display=(v===''||c.dataset.scope===v)?'':'none';});});}
var only=location.hash.match(/^#only=([\w-]+)$/);
if(only){document.querySelectorAll('body > *').forEach(function(e){
 if(e.tagName!=='SCRIPT'&&e.id!==only[1]){e.style.display='none';}});}
document.body.setAttribute('data-ready','1');"""


# -- the report -------------------------------------------------------------------------------
def build_report(ws: Workspace, npu_run: Optional[Run] = None, golden_run: Optional[Run] = None,
                 step: Optional[int] = None, criteria=None, heatmap_steps: int = 8,
                 check=None) -> dict:
    """The report's content, as data: the auto check (`check`, one made with compare=True and
    write_csv=True, or made here) and what the plots draw."""
    criteria = Criteria.of(criteria)
    npu_run = npu_run or ws.run("npu")
    golden_run = golden_run or ws.default_reference(npu_run)
    if check is None:
        check = auto_check(ws, npu_run, golden_run, step, compare=True, threshold=criteria,
                           write_csv=True)
    if not check.result_file:
        raise ReportError("the auto check behind a report compares with the golden run (-c)")
    table = read_result(check.result_file)
    # the newest fix: where results go now, else one written while the workspace was writable
    fix_path = next((path for path in (os.path.join(place, "config", "fix.json")
                                       for place in reversed(ws.places))
                     if os.path.isfile(path)), None)
    fix = None
    if fix_path:
        try:
            with open(fix_path, encoding="utf-8") as f:
                fix = json.load(f)
        except (OSError, ValueError):
            fix = None
    return {"check": check.to_dict(), "auto_check": check, "ops": _ops(table, criteria),
            "result_file": check.result_file,
            "run_json": os.path.join(npu_run.path, "run.json"),
            "losses": {"npu": _losses(ws, npu_run), "golden": _losses(ws, golden_run)},
            "heatmap": _heatmap(ws, npu_run, golden_run, criteria, heatmap_steps),
            "fix": fix, "fix_file": fix_path if fix else None,
            "interrupted": {r.label: {"steps": list(r.interrupted), "why": r.why_partial}
                            for r in (npu_run, golden_run) if r.interrupted}}


def _unseen(gap: Optional[Coverage], interrupted: Dict[str, dict]) -> List[str]:
    """What the report could not see, said at its top: tensors the compare could not read,
    steps a dump left partial (killed, or stopped by a write failure)."""
    out = []
    if gap is not None and not gap.complete:
        out.append(f"<p class='unseen' id='incomplete'>Incomplete: {_e(gap.text())}; "
                   f"what follows covers what was compared.</p>")
    for label, partial in interrupted.items():
        out.append(f"<p class='unseen'>{_e(label)}: step(s) "
                   f"{_e(', '.join(map(str, partial['steps'])))} are partial "
                   f"({_e(partial['why'])}); not read.</p>")
    return out


def _words(value) -> str:
    """A value of a result as a reader says it: lists joined, yes/no, no Python reprs."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return "; ".join(_words(v) for v in value) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_words(v)}" for k, v in value.items()) or "none"
    return str(value)


def _repair_text(f: dict) -> str:
    """config/fix.json as lines: the fix, whether its proof holds, what it cost to find and
    what to train with."""
    proof = f.get("proof") or {}
    verified = _words(bool(f.get("verified")))
    if proof.get("steps"):
        verified += f" (the loss over {proof['steps']} steps against the golden's"
        verified += ", within the tolerance)" if f.get("verified") else ")"
    config = {k: v for k, v in (f.get("config") or {}).items() if v not in (None, {}, [], "")}
    return "\n".join([f"fix: {_words(f.get('fix'))}", f"verified: {verified}",
                      f"replays: {_words(f.get('replays'))}",
                      f"train with: {_words(config)}"])


def render(data: dict, out_dir: str) -> str:
    c = data["check"]
    points = data["ops"]
    first = (c.get("first_overflow") or {}).get("op_name")
    origin = (c.get("origin") or {}).get("op_name")
    marks = {}
    if first:
        marks[first] = "first-overflow"
    if origin:
        marks[origin] = "origin" + (", first overflow" if origin == first else "")
    link = lambda p: _e(os.path.relpath(p, out_dir)) if p else ""  # noqa: E731
    scopes = sorted({p["scope"] for p in points})
    s = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>precision_tool report: "
         f"{_e(c['npu_run'])} step {c['step']}</title><style>{STYLE}</style></head><body>",
         f"<h1>precision_tool report</h1><p class='verdict' id='verdict'>{_e(c['verdict'])}</p>",
         f"<p>{_e(c['npu_run'])} against {_e(c['golden_run'])}, step {c['step']}, precision mode "
         f"{_e(c['precision_mode'])}. Result: <a href='{link(data['result_file'])}'>"
         f"{_e(os.path.basename(data['result_file'] or ''))}</a>; run: <a href='"
         f"{link(data['run_json'])}'>run.json</a></p>",
         *_unseen(data["auto_check"].coverage, data.get("interrupted") or {}),
         "<h2 id='next'>Next</h2><pre>" + _e("\n".join(c["advice"])) + "</pre>"]
    if c.get("origin"):
        o = c["origin"]
        title = c.get("origin_title") or "Root cause"
        s.append(f"<h2 id='root-cause'>{title}</h2><pre id='origin' data-op='{_e(o['op_name'])}'>"
                 + _e(f"{o['op_name']} ({o['op_type']}, {o['pass_name'] or 'not fused'})\n"
                      f"{'; '.join(o.get('reasons') or [])}"
                      + (f"\nsingle-op replay: {c['origin_replay']}" if c.get("origin_replay")
                         else ""))
                 + "</pre>")
    s.append(f"<h2 id='per-op'>Per op, step {c['step']}</h2><p>Scope: <select id='scope'><option "
             f"value=''>all</option>" + "".join(f"<option>{_e(x)}</option>" for x in scopes)
             + "</select> Hover a point for the op, its pass, dtypes and what decided.</p>")
    s.append(_scatter(points, "cosine", "1 - cosine", 1e-10, 2.0, marks, origin))
    s.append(_scatter(points, "norm", "|relative norm difference|", 1e-8, 10.0, marks, origin))
    legend = " ".join(f"<span style='color:{colour}'>&#9679;</span> {role}"
                      for role, colour in ROLE_COLOURS.items())
    s.insert(-2, f"<p class='legend'>{legend}; the larger red point: the origin the root cause "
                 f"names; below the axis: exactly equal</p>")
    shown = [dict(op=d["op_name"], type=d["op_type"], role=d["role"], category=d["category"],
                  worst_cosine=f'{min([x for x in d["output_cosines"] if x == x] or [float("nan")]):.8f}',
                  why="; ".join(r for r in d["output_reasons"] if r))
             for d in c.get("diverging", [])]
    if shown:
        s.append("<h3>Diverging ops</h3>" + _table(shown, ["op", "type", "role", "category",
                                                         "worst_cosine", "why"]))
    ls = c.get("loss_scale")
    steps = (ls or {}).get("steps", 0)
    s.append("<h2 id='steps'>Across steps</h2>")
    losses = data["losses"]["npu"]
    if steps <= 1 and len(losses) <= 1:          # nothing to draw: one line, no empty plots
        s.append("<p id='one-step'>One step observed: nothing across steps to draw"
                 + (f" (its loss: {next(iter(losses.values())):.6g})" if losses else "")
                 + ". Dump more steps (dump_step=\"0-9\") to see the loss and the loss scale "
                   "move.</p>")
        ls = None
    if ls:
        s.append(_bars(steps, ls["overflow_steps"], f"overflowed ({len(ls['overflow_steps'])})",
                       "overflow"))
        s.append(_bars(steps, ls["skipped_steps"], f"skipped ({len(ls['skipped_steps'])})", "skipped"))
        scale = {0: ls["first_scale"]}
        scale.update({st: b for st, _, b in ls["moves"]})
        if ls["first_scale"] == ls["first_scale"]:
            s.append(_line(scale, "loss scale", "scale"))
    if ls is not None or steps > 1 or len(losses) > 1:
        s.append(_line(losses, "loss of the dumped NPU steps", "loss"))
    if data["heatmap"]:
        s.append("<h2 id='heatmap'>Worst cosine per layer and step</h2>" + _heat(data["heatmap"]))
    fusion = c.get("fusion") or {}
    s.append("<h2 id='fusion'>Fusion</h2>" + (_table([{"pass": k, "fused nodes": v}
                                                      for k, v in fusion.items()], ["pass", "fused nodes"])
                                            if fusion else "<p>no fusion record</p>"))
    if c.get("watchpoints"):
        s.append("<h2 id='watchpoints'>Training watchpoints</h2>" + _table(
            c["watchpoints"], ["step", "condition", "message", "count", "session"]))
    if data["fix"]:
        f = data["fix"]
        s.append("<h2 id='repair'>Precision repair</h2><pre>" + _e(_repair_text(f))
                 + f"</pre><p><a href='{link(data['fix_file'])}'>fix.json</a></p>")
    body = re.sub(r"<h2 id='([\w-]+)'>", r"</section><section id='\1'><h2>", "".join(s))
    body = body.replace("</section>", "", 1) + "</section>"      # one section per heading
    return body + f"<script>{SCRIPT}</script></body></html>"


@dataclass
class WrittenReport:
    """What `report` wrote: the file, the auto check's verdict and the step it judged."""
    report: str
    verdict: str
    step: Optional[int]

    @classmethod
    def of(cls, path: str, data: dict) -> "WrittenReport":
        check = data["auto_check"]
        return cls(path, check.verdict, check.step)

    def to_dict(self) -> dict:
        return asdict(self)


def write_report(ws: Workspace, path: Optional[str] = None, **kw) -> tuple:
    """Build and write the report (default report.html where results go: the workspace,
    when it can be written): (path, its data)."""
    data = build_report(ws, **kw)
    path = os.path.abspath(path or os.path.join(ws.results_dir(), "report.html"))
    write_text_atomic(path, render(data, os.path.dirname(path)))
    os.chmod(path, 0o644)            # an artifact to attach and share
    return path, data
