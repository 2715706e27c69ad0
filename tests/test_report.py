"""The HTML report: drawn from ac -c's results, one self-contained file, checked in headless
Chromium (the script runs without a console error, the origin is marked, each plot holds one
point per compared output, a screenshot per section); the same errors and exit codes as ac."""
import math
import os
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from precision_tool.analysis import read_result
from precision_tool.cli import cli
from precision_tool.dump import Workspace

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-headless-shell", "chromium-browser",
                                           "google-chrome") if shutil.which(n)), None)
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (.ci/run "
                                   "installs Debian's chromium with apt-get where it can)")
SOFTMAX = "encoder/layer_0/attention/Softmax"
SECTIONS = ("next", "root-cause", "per-op", "steps", "fusion")


def invoke(root, *args):
    return CliRunner().invoke(cli, ["--data-dir", str(root), *args])


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    import scenarios
    root = tmp_path_factory.mktemp("report") / "pd"
    scenarios.softmax_overflow(str(root))
    return root


def browse(path, *flags, fragment=""):
    """Headless Chromium on the file: (its DOM after the scripts ran, its console lines)."""
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--enable-logging=stderr", "--v=0", *flags, f"file://{path}{fragment}"],
                         capture_output=True, text=True, timeout=120)
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    return out.stdout, console


def test_the_report_holds_what_ac_found(one_step, tmp_path):
    out = invoke(one_step, "report", "-o", str(tmp_path / "r.html"))
    assert out.exit_code == 1, out.output                 # findings, as ac -c
    text = (tmp_path / "r.html").read_text()
    assert os.path.getsize(tmp_path / "r.html") < 5 * 2 ** 20
    assert "http://" not in text and "https://" not in text          # nothing fetched
    assert f"data-op='{SOFTMAX}'" in text                            # the root-cause panel
    ac = invoke(one_step, "--json", "ac", "-c")
    assert '"verdict": "findings"' in ac.output
    assert invoke(one_step, "ac", "-c", "--html", str(tmp_path / "a.html")).exit_code == 1
    assert os.path.getsize(tmp_path / "a.html") > 10_000
    assert "id='repair'" not in text                      # no repair yet: no section for it
    assert invoke(one_step, "fix", "-j", "1").exit_code == 0
    repaired = invoke(one_step, "report", "-o", str(tmp_path / "f.html"))
    assert repaired.exit_code == 1
    section = (tmp_path / "f.html").read_text()
    assert "id='repair'" in section and "SoftmaxFusionPass off" in section


@needs_browser
def test_the_report_in_a_browser(one_step, tmp_path):
    path = str(tmp_path / "r.html")
    assert invoke(one_step, "report", "-o", path).exit_code == 1
    dom, console = browse(path, "--dump-dom")
    assert console == [], console                       # no error, no warning, no log line
    assert 'data-ready="1"' in dom                       # the script ran to its end
    marked = re.findall(r'<circle[^>]*class="pt origin first-origin"[^>]*data-op="([^"]+)"', dom)
    assert marked and set(marked) == {SOFTMAX}
    assert re.search(rf'<line[^>]*class="mark origin"[^>]*data-op="{re.escape(SOFTMAX)}"', dom)
    # one point per compared output with a finite cosine, in each of the two plots
    ws = Workspace(str(one_step))
    result = sorted(os.listdir(os.path.join(ws.root, "temp", "vector_compare")))[-1]
    folder = os.path.join(ws.root, "temp", "vector_compare", result)
    table = read_result(os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".csv"))))
    outputs = [":output:" in t for t in table["TensorIndex"]]
    finite = sum(math.isfinite(c) for c, out in zip(table["CosineSimilarity"], outputs) if out)
    cosine_plot = dom[dom.index('data-plot="cosine"'):dom.index('data-plot="norm"')]
    assert cosine_plot.count("<circle") == finite
    for section in SECTIONS:
        shot = tmp_path / f"{section}.png"
        browse(path, f"--screenshot={shot}", "--window-size=1000,800", fragment=f"#only={section}")
        assert shot.stat().st_size > 5_000, section


@needs_browser
def test_several_steps_give_the_step_plots_and_the_heatmap(tmp_path):
    import scenarios
    root = tmp_path / "pd"
    scenarios.carried_state_all(str(root))
    path = str(tmp_path / "r.html")
    assert invoke(root, "report", "-o", path).exit_code == 1
    dom, console = browse(path, "--dump-dom")
    assert console == [], console
    assert 'id="heatmap"' in dom or "id='heatmap'" in dom
    heat = dom[dom.index('class="heatmap"'):]
    heat = heat[:heat.index("</table>")]
    assert heat.count("<th>step ") == 3 and heat.count('class="cell ') >= 3
    assert 'data-plot="loss"' in dom and dom.count('class="loss"') >= 3    # one point per step


def test_a_broken_workspace_fails_as_ac_does(one_step, tmp_path):
    assert invoke(tmp_path / "none", "report").exit_code == 2
    lonely = tmp_path / "lonely"
    shutil.copytree(one_step / "npu", lonely / "npu")
    for args in (("report",), ("ac", "-c")):
        out = invoke(lonely, *args)
        assert out.exit_code == 2 and out.stderr.count("error:") == 1, out.output
    half = tmp_path / "half"
    shutil.copytree(one_step, half)
    step = Workspace(str(half)).step_path(Workspace(str(half)).run("npu"), 0)
    for f in sorted(os.listdir(step))[::9][:4]:
        if f.endswith(".npy"):
            os.remove(os.path.join(step, f))
    out = invoke(half, "report", "-o", str(tmp_path / "h.html"))
    assert out.exit_code == 2 and "incomplete" in out.stderr
    assert "id='incomplete'" in (tmp_path / "h.html").read_text()     # the file says it too
    partial = Workspace(str(half)).step_path(Workspace(str(half)).run("npu"), 0)
    os.makedirs(os.path.join(os.path.dirname(partial), ".1.partial"))   # a killed dump
    invoke(half, "report", "-o", str(tmp_path / "k.html"))
    assert "step(s) 1 are partial (the dump was killed" in (tmp_path / "k.html").read_text()


# -- the pictures: computed styles in the browser ------------------------------------------
COMPUTED = """<script>(function(){
 var out={points:[],cells:[],lines:[],empty:[],text:document.body.innerText};
 document.querySelectorAll('circle.pt').forEach(function(c){var s=getComputedStyle(c);
  out.points.push({op:c.dataset.op,tensor:c.dataset.tensor,fill:s.fill});});
 document.querySelectorAll('td.cell').forEach(function(c){var s=getComputedStyle(c);
  out.cells.push({kind:c.className,back:s.backgroundColor,fore:s.color,title:c.title});});
 document.querySelectorAll('polyline').forEach(function(p){var s=getComputedStyle(p);
  out.lines.push({cls:p.getAttribute('class'),fill:s.fill,stroke:s.stroke});});
 document.querySelectorAll('svg').forEach(function(g){
  if(!g.querySelector('circle,rect,polyline')){out.empty.push(g.dataset.plot||'?');}});
 document.querySelectorAll('section').forEach(function(sec){
  if(sec.getBoundingClientRect().height>1500){out.empty.push('tall:'+sec.id);}});
 var pre=document.createElement('pre');pre.id='computed';pre.textContent=JSON.stringify(out);
 document.body.appendChild(pre);})();</script>"""

RGB = {"#d62728": "rgb(214, 39, 40)", "#ff7f0e": "rgb(255, 127, 14)", "#1f77b4": "rgb(31, 119, 180)"}


def computed(path, tmp_path):
    """The report opened in Chromium with a probe appended to a copy: what it draws, as the
    browser computed it (fills, backgrounds, text colours, the page's text)."""
    import html as html_module
    import json
    probe = tmp_path / "probe.html"
    probe.write_text(open(path, encoding="utf-8").read().replace("</body>", COMPUTED + "</body>"))
    dom, console = browse(str(probe), "--dump-dom", "--window-size=1000,800")
    assert console == [], console
    found = re.search(r'<pre id="computed">(.*?)</pre>', dom, re.S)
    return json.loads(html_module.unescape(found.group(1)))


def _rgb(text):
    return tuple(int(v) for v in re.findall(r"\d+", text)[:3])


def _contrast(a, b):
    """WCAG 2.x contrast ratio (its definition of relative luminance), for the test's own
    reading of what the browser drew."""
    import numpy as np
    srgb = np.array([a, b], dtype=np.float64) / 255.0
    linear = np.where(srgb <= 0.04045, srgb / 12.92, ((srgb + 0.055) / 1.055) ** 2.4)
    lum = linear @ np.array([0.2126, 0.7152, 0.0722])
    return float((lum.max() + 0.05) / (lum.min() + 0.05))


def _verdicts(root):
    """The CSV of the newest compare: tensor -> its Verdict."""
    ws = Workspace(str(root))
    parent = os.path.join(ws.root, "temp", "vector_compare")
    folder = os.path.join(parent, sorted(os.listdir(parent))[-1])
    table = read_result(os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".csv"))))
    return dict(zip(table["TensorIndex"], table["Verdict"]))


def _check_pictures(root, tmp_path, name):
    import json
    path = str(tmp_path / f"{name}.html")
    assert invoke(root, "report", "-o", path).exit_code in (0, 1)
    seen = computed(path, tmp_path)
    ac = json.loads(invoke(root, "--json", "ac", "-c", "-l", "0").stdout)
    findings = {d["op_name"] for d in ac["diverging"] if d["role"] in ("origin", "propagator")}
    harmless = {d["op_name"] for d in ac["diverging"]
                if d["role"] in ("cancellation", "no effect", "no-effect", "gradual")}
    verdicts = _verdicts(root)
    # each point's colour agrees with the CSV's verdict and with what ac makes of its op
    assert seen["points"]
    for p in seen["points"]:
        verdict = verdicts[p["tensor"]]
        if verdict == "pass":
            assert p["fill"] == RGB["#1f77b4"], p
        hot = p["fill"] in (RGB["#d62728"], RGB["#ff7f0e"])
        assert hot == (p["op"] in findings and verdict in ("fail", "nonfinite")), (p, verdict)
        if p["op"] in harmless and verdict in ("fail", "nonfinite"):
            r, g, b = _rgb(p["fill"])
            assert r == g == b, p                 # grey: diverges without effect
    # the loss (and the loss scale) are lines, not filled shapes
    for line in seen["lines"]:
        assert line["fill"] == "none" and line["stroke"] not in ("none", ""), line
    # heatmap cells: red only for a finding; every text readable on its background
    for cell in seen["cells"]:
        back = _rgb(cell["back"])
        if "finding" not in cell["kind"]:
            assert back[0] == back[1] == back[2], cell
        assert _contrast(back, _rgb(cell["fore"])) >= 4.5, cell
    # no Python reprs, no empty picture, no section of white space
    assert not re.search(r"\[\'|\'\]|: True\b|: False\b|: None\b", seen["text"]), seen["text"][:2000]
    assert seen["empty"] == [], seen["empty"]
    return seen


@needs_browser
def test_the_pictures_agree_with_the_verdicts(one_step, tmp_path):
    """One step dumped, the fused softmax the origin: red is the origin and what carries it,
    nothing else; the steps section is one line, not empty plots; the repair says what it is
    in words."""
    assert invoke(one_step, "fix", "-j", "1").exit_code == 0
    seen = _check_pictures(one_step, tmp_path, "one")
    assert "One step observed" in seen["text"] and "loss scale move" in seen["text"]
    assert "fix: fusion pass SoftmaxFusionPass off" in seen["text"]
    assert "verified: yes" in seen["text"]


@needs_browser
def test_a_gradual_divergence_is_grey_in_every_picture(tmp_path):
    """12 dense + BatchNorm + ReLU layers under force_fp16 (test_compare's): the backward
    crosses cosine 0.98 gradually. Those ops are grey, no cell is a finding."""
    from test_compare import _deep_batch_norm_step
    root = tmp_path / "pd"
    _deep_batch_norm_step(str(root))
    seen = _check_pictures(root, tmp_path, "gradual")
    grey = [p for p in seen["points"] if len(set(_rgb(p["fill"]))) == 1]
    assert grey and not any(p["fill"] in (RGB["#d62728"], RGB["#ff7f0e"])
                            for p in seen["points"])


@needs_browser
def test_a_divergence_without_effect_is_grey_in_every_picture(tmp_path):
    """A healthy Transformer over four steps: the key bias's update drifts without effect
    (cosine below 0; the old heatmap painted it full red): grey points, grey cells."""
    import scenarios
    root = tmp_path / "pd"
    scenarios._healthy("transformer", False, steps=4)(str(root))
    seen = _check_pictures(root, tmp_path, "healthy")
    harmless = [c for c in seen["cells"] if "harmless" in c["kind"]]
    assert harmless and all(float(c["title"].rsplit(" ", 1)[1]) < 0.9 for c in harmless)
    assert not any("finding" in c["kind"] for c in seen["cells"])
    assert any(line["cls"] == "loss" for line in seen["lines"])
