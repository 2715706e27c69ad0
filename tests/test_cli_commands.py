"""Every command through click's runner on the demo workspace: exit codes, output, and
--json checked against the analysis API's own result."""
import json
import os
import re

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

import precision_tool as pt
from precision_tool import analysis, hooks, numerics
from precision_tool.cli import cli, main
from precision_tool.fileio import jsonable
from precision_tool.dump import Workspace

SOFTMAX = "encoder/layer_0/attention/Softmax"


def invoke(root, *args):
    result = CliRunner().invoke(cli, ["--data-dir", str(root), *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def as_json(root, *args):
    result = invoke(root, "--json", "--log-level", "4", *args)
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo") / "precision_data"
    result = invoke(root, "demo", "--steps", "3")
    return root, result


def test_demo_trains_dumps_and_ends_with_the_ac_report(demo):
    root, result = demo
    assert result.exit_code == 1                     # it has a precision problem to show
    out = result.stdout
    assert "after 3 steps  loss" in out and "Fusion" in out and "Overflow" in out
    assert "Root cause" in out and "SoftmaxFusionPass" in out
    assert out.rstrip().splitlines()[-1].startswith("╰") and "Next" in out.split("Root cause")[1]
    ws = Workspace(str(root))
    assert [r.name for r in ws.runs("npu")] == ["debug_0"] and ws.runs("cpu")


def test_demo_moves_an_old_workspace_aside_but_not_the_shipped_readme(tmp_path):
    from precision_tool.cli.jobs import _move_aside
    root = tmp_path / "precision_data"
    root.mkdir()
    (root / "README.md").write_text("the layout")
    assert _move_aside(str(root)) is None            # a fresh clone's workspace: nothing to move
    (root / "npu" / "debug_0").mkdir(parents=True)
    (root / "npu" / "debug_0" / "run.json").write_text("{}")
    (root / "temp").mkdir()
    aside = _move_aside(str(root))
    assert sorted(os.listdir(root)) == ["README.md"]
    assert sorted(os.listdir(aside)) == ["npu", "temp"]
    assert (tmp_path / os.path.basename(aside) / "npu" / "debug_0" / "run.json").read_text() == "{}"
    (root / "cpu").mkdir()
    again = _move_aside(str(root))                   # in the same second: a name of its own
    assert again != aside and os.listdir(again) == ["cpu"] and os.listdir(aside)
    assert _move_aside(str(tmp_path / "missing")) is None


def test_vcs_exit_codes_and_the_origin_first(demo):
    root, _ = demo
    result = invoke(root, "vcs", "-c", "0.98", "-l", "10")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    panels = [line for line in lines if line.startswith("╭")]
    assert len(panels) == 10 and SOFTMAX in panels[0] and "[origin]" in panels[0]
    # the result file's path is a line of its own, whole, however narrow the terminal; then
    # what it holds
    assert lines[0].startswith(str(root)) and os.path.isfile(lines[0])
    assert lines[1] == "npu/debug_0 against cpu/debug_0, step 0"       # what it summarises
    assert re.fullmatch(rf"\d+ op\(s\) diverge, origin {SOFTMAX}", lines[2])
    # thresholds nothing reaches: nothing diverges (the same file, judged again)
    assert invoke(root, "vcs", "-c", "-1", "--norm", "1e9", "--flushed", "1", "--rel-error",
                  "1e9").exit_code == 0
    code, data = as_json(root, "vcs", "-l", "0")
    table = pd.read_csv(data["file"], keep_default_na=False, na_values=["nan", ""])
    api = analysis.summarize(table, 0.98, limit=0)
    assert data["origin"] == analysis.root_cause(table).first_origin.op_name == SOFTMAX
    assert [o["op_name"] for o in data["ops"] if o["category"] not in ("cancellation", "no effect")] == \
        [s.op_name for s in api if s.is_finding]


def test_vcs_of_statistics_only_dumps_shows_how_far_apart_the_norms_are(tmp_path):
    """Dumps of statistics only have no cosines: vcs says so and shows each listed op's
    relative norm differences (those of the result file) where it shows cosines otherwise."""
    root = tmp_path / "precision_data"
    m = pt.models.transformer()
    d = pt.data.digits()
    cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="allow_mix_precision"),
                                    action="dump", data_dir=str(root), dump_data="stats")
    with pt.Session(m.graph, target="npu", config=cfg) as npu, \
            hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=str(root),
                            dump_data="stats") as cpu:
        for sess in (npu, cpu):
            sess.run([m.loss, m.train_op], {m.x: d.x_train[:32], m.y: d.y_train[:32]})
    result = invoke(root, "vcs", "-l", "0")
    lines = result.stdout.splitlines()
    assert re.match(r"\d+ op\(s\) diverge \(statistics only: judged by the norms\)",
                    lines[2]), lines[2]
    assert "cosines" not in result.stdout and "relative differences of the norms" in result.stdout
    code, data = as_json(root, "vcs", "-l", "0")
    assert data["statistics_only"] and data["ops"]
    table = pd.read_csv(data["file"], keep_default_na=False, na_values=["nan", ""])
    by_tensor = dict(zip(table.NPUDump + "|" + table.TensorIndex, table.NormRelativeDiff))
    for op in data["ops"]:
        assert op["statistics_only"] and len(op["output_norm_diffs"]) == len(op["output_cosines"])
        outputs = [t for t in by_tensor if t.startswith(op["op_name"] + "|")
                   and ":output:" in t]
        assert sorted(op["output_norm_diffs"]) == sorted(by_tensor[t] for t in outputs)


def test_missing_or_corrupt_workspace_exits_2_with_one_line(tmp_path, capsys):
    assert main(["--data-dir", str(tmp_path / "none"), "vcs"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no workspace" in err
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\x00\xff garbage")
    (tmp_path / "ws").mkdir()
    assert main(["--data-dir", str(tmp_path / "ws"), "vcs", "-f", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not" in err and "Traceback" not in err
    assert main(["vsc"]) == 2 and "did you mean vc or vcs" in capsys.readouterr().err


def test_ac_json_is_the_analysis_result(demo):
    root, _ = demo
    code, data = as_json(root, "ac", "-c", "-l", "5")
    ws = Workspace(str(root))
    api = jsonable(analysis.auto_check(ws, compare=True, limit=5).to_dict())
    data.pop("result_file"), api.pop("result_file")
    assert code == 1 and data == api
    assert data["first_overflow"]["op_name"] == SOFTMAX and data["origin"]["pass_name"] == "SoftmaxFusionPass"
    assert os.path.isfile(invoke(root, "--json", "ac", "-c").stdout and
                          json.loads(invoke(root, "--json", "--log-level", "4", "ac", "-c").stdout)["result_file"])


def test_vc_writes_a_result_and_counts_verdicts(demo):
    root, _ = demo
    code, data = as_json(root, "vc")
    ws = Workspace(str(root))
    table = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    assert code == 1 and data["rows"] == len(table)
    assert data["verdicts"] == table.Verdict.value_counts().to_dict()
    assert len(pd.read_csv(data["result_file"])) == len(table)
    text = invoke(root, "vector-compare", "-c", "-1", "--norm", "1e9", "--flushed", "1",
                  "--rel-error", "1e9")       # the long alias; thresholds nothing reaches
    assert text.exit_code == 0 and "result:" in text.stdout
    graph = os.path.join(ws.run("npu").path, "graph", os.listdir(os.path.join(ws.run("npu").path, "graph"))[0])
    code, same = as_json(root, "vc", "-g", graph)
    assert same["verdicts"] == data["verdicts"]
    bad = os.path.join(str(root), "not_a_graph.json")
    open(bad, "w").write("[1, 2")
    result = invoke(root, "vc", "-g", bad)
    assert result.exit_code == 2 and "compiled graph" in result.stderr


def test_ls_counts_and_literal_filters(demo):
    root, _ = demo
    code, listing = as_json(root, "ls")
    assert code == 0 and listing["counts"]["npu/debug_0"]["SoftmaxV2"] == 1
    assert {r["run"] for r in listing["runs"]} >= {"npu/debug_0", "cpu/debug_0"}
    assert all(r["bytes"] > 0 for r in listing["runs"] if r["steps"])
    code, found = as_json(root, "ls", "-f", "Softmax")
    assert [f["name"] for f in found] == [SOFTMAX] and found[0]["kernel"] == "vector_float16"
    code, found = as_json(root, "ls", "-n", "attention/(Soft")     # literal, no regex error
    assert code == 0 and found == []
    code, found = as_json(root, "list", "-t", "LayerNorm", "-k", "float32")
    assert len(found) == 2 and all(f["type"] == "LayerNorm" for f in found)


def test_ni_shows_the_op_its_files_and_exports_dot(demo):
    root, _ = demo
    code, info = as_json(root, "ni", SOFTMAX, "-s", "1")
    assert code == 0 and info["type"] == "SoftmaxV2" and info["pass_name"] == "SoftmaxFusionPass"
    assert {d["io"] for d in info["dump"]} == {"input", "output"}
    assert info["golden"][0]["tensor"] == f"{SOFTMAX}:0"
    dot = open(info["dot_file"]).read()
    assert dot.startswith("digraph") and "encoder/layer_0/attention/Mul" in dot
    result = invoke(root, "ni", "Softmax")                   # inexact: the candidates
    assert result.exit_code == 2 and "op(s) whose name holds it" in result.stderr
    assert SOFTMAX in result.stderr
    for typo in ("Softmx", "encoder/layer_0/atention/Softmax"):   # mistyped: the closest names
        result = invoke(root, "ni", typo)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1
        assert f"no op {typo!r}" in result.stderr and f"did you mean {SOFTMAX}" in result.stderr
    result = invoke(root, "ni", "zzz")
    assert result.exit_code == 2 and "did you mean" not in result.stderr


def test_ni_says_what_of_a_tensor_is_not_finite(tmp_path):
    """ni's max, min and mean are over the finite elements: an output that overflowed to
    inf says so beside them (186 +inf, not a max of 64736 alone), and a row that holds none
    says nothing."""
    root = tmp_path / "precision_data"
    g = pt.Graph("big", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [6])
        y = pt.ops.mul(x, pt.constant(1e4, name="k"), name="big")
    sess = pt.Session(g, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="force_fp16", overflow_mode="inf_nan"), action="dump",
        data_dir=str(root)))
    sess.run([y], {x: np.array([1, -2, 3, 50, -70, 0.5], np.float32)})
    sess.close()
    code, info = as_json(root, "ni", "big")
    out = next(d for d in info["dump"] if d["io"] == "output")
    assert code == 0 and (out["pos_inf_count"], out["neg_inf_count"]) == (1, 1), info["dump"]
    text = invoke(root, "ni", "big").stdout
    row = next(line for line in text.splitlines() if line.startswith("output0"))
    assert "1 +inf, 1 -inf" in row and "30000" in row
    assert "inf" not in next(line for line in text.splitlines() if line.startswith("input0"))


def test_pt_prints_the_statistics_of_the_file(demo):
    root, _ = demo
    result = invoke(root, "pt", "Softmx:output:0")          # mistyped: the closest op names
    assert result.exit_code == 2 and f"did you mean {SOFTMAX}" in result.stderr
    code, info = as_json(root, "pt", SOFTMAX, "-c")
    ws = Workspace(str(root))
    table = ws.index(ws.run("npu"), 0)
    row = table[(table.op_name == SOFTMAX) & (table.io == "output")].iloc[0]
    value = ws.load(ws.run("npu"), 0, row.file)
    assert info["max"] == float(value.max()) and info["l2norm"] == pytest.approx(
        float(np.linalg.norm(value.astype(np.float64))), rel=1e-12)
    assert info["head"] == value.reshape(-1)[:16].astype(float).tolist()
    copy = np.loadtxt(info["copy"])
    assert copy.size == value.size and np.array_equal(copy, value.reshape(-1).astype(np.float64))
    assert invoke(root, "pt", "no/such/op").exit_code == 2


def test_cp_compares_two_tensors_and_refuses_a_size_mismatch(demo):
    root, _ = demo
    code, r = as_json(root, "cp", f"{SOFTMAX}:output:0", f"{SOFTMAX}:0", "-p", "3")
    assert code == 1 and not r["allclose"] and len(r["top_items"]) == 3
    ws = Workspace(str(root))
    npu_t, cpu_t = (ws.index(ws.run(t), 0) for t in ("npu", "cpu"))
    x = ws.load(ws.run("npu"), 0, npu_t[(npu_t.op_name == SOFTMAX) & (npu_t.io == "output")].file.iloc[0])
    y = ws.load(ws.run("cpu"), 0, cpu_t[cpu_t.tensor == f"{SOFTMAX}:0"].file.iloc[0])
    a, b = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    assert r["cosine"] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), rel=1e-12, abs=0)
    assert r["error_count"] == int((np.abs(a - b) > 1e-3 + 1e-3 * np.abs(b)).sum())
    assert r["top_items"][0]["abs_error"] == pytest.approx(np.abs(a - b).max())
    assert "|left - right| > atol + rtol * |right|" in invoke(root, "cp", f"{SOFTMAX}:0", f"{SOFTMAX}:0",
                                                               "-lr", "cpu/debug_0", "-s").stdout
    same = invoke(root, "cp", f"{SOFTMAX}:0", f"{SOFTMAX}:0", "-lr", "cpu/debug_0")
    assert same.exit_code == 0 and "cosine 1.0" in same.stdout
    mismatch = invoke(root, "cp", f"{SOFTMAX}:0", "encoder/layer_0/attention_norm/Add_1:0")
    assert mismatch.exit_code == 2 and "sizes differ" in mismatch.stderr


@pytest.mark.parametrize("with_workspace", [False, True])
def test_pt_cp_and_dc_take_any_npy_file_by_its_path(demo, tmp_path, with_workspace):
    # files of the user's own, outside any workspace: read as dumps are, never confined to one
    root = demo[0] if with_workspace else tmp_path / "none"
    rng = np.random.default_rng(3)
    left = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    right = left + np.float32(1e-2) * rng.standard_normal(left.shape).astype(np.float32)
    np.save(tmp_path / "left.npy", left)
    np.save(tmp_path / "right.npy", right)
    code, r = as_json(root, "cp", str(tmp_path / "left.npy"), str(tmp_path / "right.npy"))
    a, b = left.astype(np.float64).ravel(), right.astype(np.float64).ravel()
    assert code == 1 and r["elements"] == a.size
    assert r["cosine"] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), rel=1e-12, abs=0)
    assert r["error_count"] == int((np.abs(a - b) > 1e-3 + 1e-3 * np.abs(b)).sum())
    code, info = as_json(root, "pt", str(tmp_path / "left.npy"), "-c")
    assert code == 0 and info["max"] == float(left.max())
    where = os.path.join(str(root), "temp", "print_tensor") if with_workspace else str(tmp_path)
    assert os.path.dirname(info["copy"]) == where
    assert np.array_equal(np.loadtxt(info["copy"]), a)
    code, info = as_json(root, "dc", str(tmp_path / "left.npy"), "-f", "NHWC")
    assert code == 0 and np.array_equal(np.load(info["file"]), left.transpose(0, 2, 3, 1))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "left.npy").read_bytes()[:200])
    for args in (("pt", str(tmp_path / "cut.npy")), ("cp", str(tmp_path / "cut.npy"), str(tmp_path / "right.npy"))):
        result = invoke(root, *args)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "corrupt" in result.stderr
    assert not (tmp_path / "none").exists()          # nothing made where no workspace was
    if with_workspace:         # a file outside named like a dump file is still the file given
        ws = Workspace(str(root))
        dumped = ws.index(ws.run("npu"), 0).file.iloc[0]
        np.save(tmp_path / dumped, left)
        code, info = as_json(root, "pt", str(tmp_path / dumped))
        assert code == 0 and info["shape"] == list(left.shape) and info["max"] == float(left.max())
    missing = invoke(root, "pt", str(tmp_path / "nothing.npy"))
    assert missing.exit_code == 2 and "Traceback" not in missing.stderr


def test_dc_converts_a_5hd_dump_to_nchw_and_nhwc(tmp_path):
    m = pt.models.cnn()
    d = pt.data.digits()
    pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        action="dump", data_dir=str(tmp_path))).run(m.loss, {m.x: d.x_train[:4], m.y: d.y_train[:4]})
    ws = Workspace(str(tmp_path))
    table = ws.index(ws.run("npu"), 0)
    row = table[(table.format == "NC1HWC0") & (table.io == "output")].iloc[0]
    code, info = as_json(tmp_path, "dc", row.file)
    raw = ws.load(ws.run("npu"), 0, row.file)
    c, h, w = (int(v) for v in row.original_shape.split()[1:])     # the batch may be None
    want = numerics.five_hd_to_nchw(raw, (raw.shape[0], c, h, w))
    assert code == 0 and info["from"] == "NC1HWC0" and np.array_equal(np.load(info["file"]), want)
    code, info = as_json(tmp_path, "dc", row.file, "-f", "NHWC")
    assert np.array_equal(np.load(info["file"]), want.transpose(0, 2, 3, 1))


def test_fo_names_the_pass_and_leaves_the_default_run_alone(demo):
    root, _ = demo
    code, verdict = as_json(root, "fo")
    assert code == 1 and verdict["culprits"] == ["SoftmaxFusionPass"] and verdict["replays"] >= 3
    ws = Workspace(str(root))
    # the fusion-off replay stays (vc compares it); the bisection's others are deleted
    assert [r.name for r in ws.runs("npu")] == ["debug_0", verdict["kept"][0]]
    assert verdict["kept"] == verdict["runs"][:1] and ws.run("npu").name == "debug_0"
    assert ws.run("npu", verdict["kept"][0]).info["replay_of"] == "npu/debug_0"
    code, kept = as_json(root, "fo", "--keep-replays")
    assert code == 1 and kept["kept"] == kept["runs"] and len(kept["runs"]) == verdict["replays"]
    assert len(Workspace(str(root)).runs("npu")) == 2 + kept["replays"]
    code, made = as_json(root, "train", "-d", "all", "-a", "fusion_off")
    assert code == 0 and len(made["runs"]) == 2
    assert Workspace(str(root)).run("npu").name == "debug_0"     # analyses still default to it


def test_replaying_the_overflow_check_says_what_overflowed(demo, tmp_path):
    root, _ = demo
    code, made = as_json(root, "train", "-d", "npu", "-a", "overflow")
    assert code == 1 and made["overflow"] == {"kernels": 1, "first": SOFTMAX}
    text = invoke(root, "train", "-d", "npu", "-a", "overflow")
    assert text.exit_code == 1 and f"1 overflowing kernel(s), the first {SOFTMAX}" in text.stdout
    # a step that does not overflow: said so, exit 0
    m = pt.models.mlp()
    d = pt.data.digits()
    sess = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="dump", dump_step="0", data_dir=str(tmp_path)))
    sess.run([m.loss, m.train_op], {m.x: d.x_train[:32], m.y: d.y_train[:32]})
    code, made = as_json(tmp_path, "train", "-d", "npu", "-a", "overflow")
    assert code == 0 and made["overflow"] == {"kernels": 0, "first": None}
    assert "no overflow" in invoke(tmp_path, "train", "-d", "npu", "-a", "overflow").stdout


def test_log_level_and_internal_errors(demo, monkeypatch, capsys):
    root, _ = demo
    quiet = invoke(root, "--log-level", "4", "ac", "-c")
    assert quiet.stderr == ""
    assert "comparing" in invoke(root, "--log-level", "1", "ac", "-c").stderr

    def boom(*a, **k):
        raise RuntimeError("planted bug")
    monkeypatch.setattr(analysis, "auto_check", boom)
    assert main(["--data-dir", str(root), "ac"]) == 3
    err = capsys.readouterr().err
    assert err.strip() == "internal error: RuntimeError: planted bug"


def test_help_lists_every_command_with_its_alias():
    out = CliRunner().invoke(cli, ["--help"]).stdout
    for words in ("ac, auto-check", "vcs, vector-summary", "vc, vector-compare", "ls, list",
                  "ni, node-info", "pt, print-tensor", "cp, compare-pair", "dc, convert",
                  "fo, fusion-off", "train, replay", "demo", "shell", "npu-dump"):
        assert words in out, words
    assert "Exit codes: 0 nothing found; 1 precision findings" in out
    assert "Exit code 1 when" in CliRunner().invoke(cli, ["vcs", "--help"]).stdout


def test_the_json_of_ac_fix_fo_and_vc_is_their_result_objects(demo):
    """--json is the analysis's result object as its to_dict (or asdict) makes it, with no
    key added or dropped by the command line: a key of AutoCheck, Repair or FusionVerdict is
    a key of its command's JSON, the coverage the Coverage's own dict."""
    import dataclasses
    from precision_tool.analysis import Coverage
    from precision_tool.analysis.autocheck import AutoCheck
    from precision_tool.analysis.replays.fusion_bisect import FusionVerdict
    from precision_tool.analysis.replays.repair import Repair
    root, _ = demo
    code, ac = as_json(root, "ac", "-c")
    assert code == 1
    assert set(ac) == {f.name for f in dataclasses.fields(AutoCheck)} | {"verdict", "origin_title"}
    assert set(ac["coverage"]) == {f.name for f in dataclasses.fields(Coverage)}
    assert Coverage(**ac["coverage"]).complete
    code, fix = as_json(root, "fix", "-j", "1", "--dry-run")
    assert code == 0
    assert set(fix) == {f.name for f in dataclasses.fields(Repair)} | {"needed", "verified"}
    code, fo = as_json(root, "fo")
    assert code == 1 and set(fo) == {f.name for f in dataclasses.fields(FusionVerdict)}
    from precision_tool.analysis import CompareReport
    code, vc = as_json(root, "vc")
    assert code == 1 and set(vc) == {f.name for f in dataclasses.fields(CompareReport)}
    assert vc["unsaved"] is None and vc["result_file"] and vc["diverging_ops"] >= 1
    assert sum(vc["verdicts"].values()) == vc["rows"]


def _fields(cls, *extra):
    import dataclasses
    return {f.name for f in dataclasses.fields(cls)} | set(extra)


def test_every_other_command_s_json_is_its_result_object(demo, tmp_path):
    """The rest of the commands: vcs, ls (runs and ops), ni, pt, cp, dc, check (and --diff),
    wp, train, clean, report and help. Each --json is one result class's to_dict, with the
    keys of its fields (and the properties its to_dict adds), nested results as their own."""
    from precision_tool.analysis import (Coverage, NodeInfo, OpRow, OpSummary, RunEntry,
                                         RunListing, TensorSummary, VectorSummary)
    from precision_tool.analysis.ops import Conversion
    from precision_tool.analysis.replays.checks import CheckReport, ConfigDiff
    from precision_tool.analysis.replays.rerun import Rerun
    from precision_tool.cli import CommandHelp, CommandList
    from precision_tool.dump.housekeeping import Cleaning, Doomed
    from precision_tool.dump.watch import WatchHits
    from precision_tool.report import WrittenReport
    root, _ = demo
    code, vcs = as_json(root, "vcs", "-l", "2")
    assert code == 1 and set(vcs) == _fields(VectorSummary)
    assert set(vcs["coverage"]) == _fields(Coverage) and len(vcs["ops"]) == 2
    assert all(set(op) == _fields(OpSummary) for op in vcs["ops"])
    code, ls = as_json(root, "ls")
    assert code == 0 and set(ls) == _fields(RunListing)
    assert all(set(r) == _fields(RunEntry) for r in ls["runs"])
    assert {r["kind"] for r in ls["runs"]} == {"device", "reference"}
    code, ops = as_json(root, "ls", "-t", "Softmax")
    assert code == 0 and ops and all(set(o) == _fields(OpRow) for o in ops)
    code, ni = as_json(root, "ni", SOFTMAX)
    assert code == 0 and set(ni) == _fields(NodeInfo) and ni["dump"] and ni["golden"]
    code, pt_ = as_json(root, "pt", SOFTMAX)
    assert code == 0 and set(pt_) == _fields(TensorSummary)
    code, cp = as_json(root, "cp", f"{SOFTMAX}:output:0", f"{SOFTMAX}:output:0", "-rr",
                       "npu/debug_0")
    assert code == 0 and cp["allclose"] and cp["cosine"] == 1.0
    left = tmp_path / "x.npy"
    np.save(left, np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4))
    code, dc = as_json(root, "dc", str(left), "-f", "NHWC")
    assert code == 0 and set(dc) == {"tensor", "from", "to", "shape", "file"} == \
        {"from", "to"} | _fields(Conversion) - {"source", "target"}
    code, check = as_json(root, "check", "--only", "data.nonfinite")
    assert code in (0, 1) and set(check) == _fields(CheckReport, "errors")
    code, diff = as_json(root, "check", "--diff", "npu/debug_0", "npu/debug_0")
    assert code == 0 and set(diff) == _fields(ConfigDiff) and diff["differences"] == []
    code, wp = as_json(root, "wp")
    assert code == 0 and set(wp) == _fields(WatchHits) and wp == {"hits": 0, "shown": []}
    code, train = as_json(root, "train", "-d", "cpu")
    assert code == 0 and set(train) == _fields(Rerun) and len(train["runs"]) == 1
    replayed = Workspace(str(root)).resolve_run(train["runs"][0], "cpu")
    assert replayed.target == "cpu" and replayed.info["replay_of"] == "npu/debug_0"
    code, clean = as_json(root, "clean", "-n")
    assert code == 0 and set(clean) == _fields(Cleaning)
    assert all(set(d) == _fields(Doomed) for d in clean["deleted"])
    assert replayed.path in [d["path"] for d in clean["deleted"]]
    code, report = as_json(root, "report", "-o", str(tmp_path / "r.html"), "--heatmap-steps", "0")
    assert code == 1 and set(report) == _fields(WrittenReport) and report["verdict"] == "findings"
    code, helps = as_json(root, "help")
    assert code == 0 and set(helps) == _fields(CommandList)
    code, one = as_json(root, "help", "vcs")
    assert code == 0 and set(one) == _fields(CommandHelp)


def test_a_command_line_dict_is_no_result():
    """--json prints a result object's to_dict: a dict made up by the command line is refused
    (the check that keeps every command's JSON its result class's)."""
    from precision_tool.cli.app import App
    app = App(".", as_json=True)
    with pytest.raises(TypeError, match="to_dict"):
        app.emit({"made": "up"}, lambda: None)
    with pytest.raises(TypeError, match="to_dict"):
        app.emit([{"made": "up"}], lambda: None)


def test_an_op_panel_sums_up_a_call_on_many_tensors():
    """A call on 142 gradients (the scaler's unscale) listed every cosine and every reason
    in its panel, thousands of characters wide: the panel shows the first eight, then how
    many more and the lowest with its position, at full precision."""
    from rich.console import Console
    from precision_tool.analysis.comparing.summary import OpSummary
    from precision_tool.cli.analyse import _render_op
    from precision_tool.cli.app import App
    cosines = [0.99999 - k * 1e-6 for k in range(142)]
    cosines[71] = 0.97974747
    s = OpSummary("Torch.unscale.0.forward", "Torch.unscale", 0, ["g"], "",
                  input_cosines=cosines, output_cosines=cosines[:3],
                  output_reasons=[f"cosine 0.{k}" for k in range(10)], role="propagator")
    console = Console(width=200, record=True)
    _render_op(App(".", console=console), s)
    shown = console.export_text()
    assert "... 134 more, the lowest input 71: 0.97974747" in shown, shown
    assert "0.999983 " in shown and "0.999982" not in shown       # the ninth on is summed up
    assert "output cosines: 0.99999 0.999989 0.999988 " in shown            # three: all shown
    assert "cosine 0.7 | ... 2 more" in shown and "cosine 0.8" not in shown
    assert max(len(line) for line in shown.splitlines()) <= 200
