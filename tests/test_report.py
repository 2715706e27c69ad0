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
    assert heat.count("<th>step ") == 3 and heat.count('class="cell"') >= 3
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
    assert "were interrupted" in (tmp_path / "k.html").read_text()
