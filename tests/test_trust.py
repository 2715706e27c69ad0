"""No silent wrong answer: every class of the trust review, through the command line. Each
test builds the case a user meets (an overflowed tensor, a file deleted, a workspace dumped
again, a killed dump...) and checks the exit code and what is said, never a traceback."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import precision_tool as pt
from harness import recorded_as
from precision_tool import hooks
from precision_tool.analysis.comparing.metrics import compare_tensors
from precision_tool.cli import cli
from precision_tool.dump import Workspace, layout

EXAMPLES = int(os.environ.get("PRECISION_TOOL_FUZZ_EXAMPLES", "25"))


def invoke(root, *args):
    result = CliRunner().invoke(cli, ["--data-dir", str(root), *args])
    # a crash would be an exception other than the exit itself
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.stderr
    return result


def as_json(root, *args):
    result = invoke(root, "--json", "--log-level", "4", *args)
    return result.exit_code, json.loads(result.stdout)


def dump(root, steps=2, scale=1.0, model="mlp", golden=True, **npu_config):
    """A model trained `steps` steps on the simulated NPU (npu_config) and, with golden, on
    the golden executor, every step dumped; inputs multiplied by `scale`."""
    m = getattr(pt.models, model)()
    d = pt.data.digits()
    when = f"0-{steps - 1}"
    sessions = [pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(**npu_config), action="dump", dump_step=when, data_dir=str(root)))]
    if golden:
        sessions.append(hooks.sess_dump(pt.Session(m.graph), action="dump", dump_step=when,
                                        data_dir=str(root)))
    losses = []
    for sess in sessions:
        for _, (xb, yb) in zip(range(steps), d.batches(32, seed=0, epoch=0)):
            loss, _ = sess.run([m.loss, m.train_op], {m.x: xb * scale, m.y: yb})
        losses.append(loss)
        sess.close()
    return losses


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Pristine workspaces, copied by each test that changes one: clean (force_fp32: nothing
    diverges) and overflowed (force_fp16, inf_nan, inputs far beyond fp16: nan loss)."""
    base = tmp_path_factory.mktemp("trust")
    dump(base / "clean", precision_mode="force_fp32")
    losses = dump(base / "overflowed", scale=1e5, precision_mode="force_fp16",
                  overflow_mode="inf_nan")
    assert np.isnan(losses[0]) and np.isfinite(losses[1])
    return base


def copy(built, name, tmp_path):
    root = tmp_path / name
    shutil.copytree(built / name, root)
    return root


def step_dir(root, target="npu", run="debug_0", step=0):
    ws = Workspace(str(root))
    return ws.step_path(ws.run(target, run), step)


# -- 1. non-finite values wherever they are shown ---------------------------------------------
def test_overflowed_tensors_are_shown_and_compared_never_crash(built, tmp_path):
    root = built / "overflowed"
    result = invoke(root, "pt", "fc1/BiasAdd", "-s", "1")
    assert result.exit_code == 0 and "nan" in result.stdout
    inf = tmp_path / "inf.npy"
    np.save(inf, np.array([np.inf, -np.inf, np.nan, 1.0, 0.0], np.float32))
    code, data = as_json(root, "pt", str(inf))
    # JSON keeps inf, -inf and nan apart (as strings: JSON has no such numbers)
    assert code == 0 and data["head"][:3] == ["inf", "-inf", "nan"]
    assert (data["nan_count"], data["pos_inf_count"], data["neg_inf_count"]) == (1, 1, 1)
    code, pair = as_json(root, "cp", str(inf), str(inf))
    assert code == 0 and pair["allclose"] and pair["nonfinite_equal"] == 3
    assert "3 non-finite element(s) left out" in pair["note"]
    text = invoke(root, "cp", str(inf), str(inf))
    assert text.exit_code == 0 and "RuntimeWarning" not in text.output and "left out" in text.stdout


def test_one_definition_of_the_edge_cases_in_cp_and_vc(tmp_path):
    """All nan, all zero, one side zero: cp's metrics are compare_tensors' (what vc writes)."""
    cases = {"nan": (np.full(4, np.nan), np.full(4, np.nan)),
             "zero": (np.zeros(4), np.zeros(4)),
             "npu zero": (np.zeros(4), np.ones(4)),
             "inf vs finite": (np.array([np.inf, 1, 2, 3]), np.arange(4.0))}
    for name, (a, b) in cases.items():
        fa, fb = tmp_path / f"{name}a.npy", tmp_path / f"{name}b.npy"
        np.save(fa, a.astype(np.float32))
        np.save(fb, b.astype(np.float32))
        result = invoke(tmp_path, "--json", "cp", str(fa), str(fb))
        data = json.loads(result.stdout)
        want = compare_tensors(a.astype(np.float32), b.astype(np.float32))
        for key, value in want.items():
            got = data["metrics"][key]
            if isinstance(value, float) and value != value:
                assert got == "nan", (name, key)
            else:
                assert got == value, (name, key, got, value)
    # two all-nan tensors: nothing finite to compare, and it is said; nan == nan element-wise
    nan = json.loads(invoke(tmp_path, "--json", "cp", str(tmp_path / "nana.npy"),
                            str(tmp_path / "nanb.npy")).stdout)
    assert nan["max_abs_error"] == "nan" and "no finite element" in nan["metrics"]["CompareFailReason"]
    one_zero = json.loads(invoke(tmp_path, "--json", "cp", str(tmp_path / "npu zeroa.npy"),
                                 str(tmp_path / "npu zerob.npy")).stdout)
    assert one_zero["cosine"] == "nan"
    mismatch = invoke(tmp_path, "cp", str(tmp_path / "inf vs finitea.npy"),
                      str(tmp_path / "inf vs finiteb.npy"))
    assert mismatch.exit_code == 1 and "1 on one side only" in mismatch.stdout


# -- 2. coverage is part of every verdict -----------------------------------------------------
def test_deleted_tensor_files_are_counted_and_never_sound(built, tmp_path):
    root = copy(built, "clean", tmp_path)
    assert invoke(root, "ac", "-c").exit_code == 0          # whole: sound
    files = sorted(f for f in os.listdir(step_dir(root)) if f.endswith(".npy"))
    for f in files[::7][:5]:
        os.remove(os.path.join(step_dir(root), f))
    code, data = as_json(root, "vc", "-s", "0")
    assert code == 2 and data["coverage"]["compared"] < data["coverage"]["tensors"]
    assert "unreadable (file missing)" in data["coverage"]["missing"]
    result = invoke(root, "ac", "-c", "-s", "0")
    assert result.exit_code == 2 and "sound" not in result.stdout
    assert "could not be compared" in result.stdout and "incomplete" in result.stderr


def test_a_later_step_compared_in_part_withholds_the_clean_verdict(built, tmp_path):
    """Plain ac -c finds step 0 sound and looks on: step 1, with a file deleted, was
    compared in part, so no clean verdict (exit 2) and the step is named."""
    root = copy(built, "clean", tmp_path)
    later = step_dir(root, step=1)
    os.remove(os.path.join(later, sorted(f for f in os.listdir(later) if f.endswith(".npy"))[3]))
    code, data = as_json(root, "ac", "-c")
    assert code == 2 and data["verdict"] == "incomplete" and data["step"] == 0
    assert list(data["unseen_steps"].values()) == [[1]]
    result = invoke(root, "ac", "-c")
    assert "looks sound in the steps compared" in " ".join(result.stdout.split())
    assert "no clean verdict" in result.stderr


def test_an_inf_written_into_a_golden_file_is_damage_not_the_model(built, tmp_path):
    """A golden tensor file with an inf the NPU does not hold, written after the dump: the
    index recorded none, so the file was changed or damaged since. It decides nothing: not
    compared (exit 2, naming the file), never "the data or the model" with exit 0."""
    root = copy(built, "clean", tmp_path)
    ws = Workspace(str(root))
    golden = ws.run("cpu")
    t = ws.index(golden, 0)
    code, data = as_json(root, "vc", "-s", "0")
    compared = pd.read_csv(data["result_file"]).GoldenTensor
    row = t[(t.io == "output") & t.tensor.isin(compared) & (t.op_type == "Relu")].iloc[0]
    path = os.path.join(ws.step_path(golden, 0), row.file)
    value = np.load(path)
    value.flat[0] = np.inf
    np.save(path, value)
    code, data = as_json(root, "vc", "-s", "0")
    assert code == 2
    assert "unreadable (nan/inf not those the dump recorded)" in data["coverage"]["missing"]
    result = invoke(root, "ac", "-c", "-s", "0")
    assert result.exit_code == 2, result.output
    assert "data or the model" not in result.stdout and "sound" not in result.stdout
    csv = pd.read_csv(data["result_file"])
    reason = csv[csv.GoldenTensor == row.tensor].CompareFailReason.iloc[0]
    assert f"{row.file} holds 1 nan/inf, its dump recorded 0" in reason


def test_an_origin_whose_input_file_is_gone_is_named_as_far_as_the_compare_saw(built, tmp_path):
    """The overflowed run's origin with its input's file deleted: the op that reads it has
    no compared input left that diverges, so it leads, and ac says which input it could not
    see and that the divergence may come in through it."""
    root = copy(built, "overflowed", tmp_path)
    code, data = as_json(root, "ac", "-c", "-s", "0")
    origin = data["origin"]["op_name"]
    ws = Workspace(str(root))
    index = ws.index(ws.run("npu"), 0)
    fed = index[(index.op_name == origin) & (index.io == "input")]
    os.remove(os.path.join(step_dir(root), fed.file.iloc[0]))
    code, data = as_json(root, "ac", "-c", "-s", "0")
    assert code == 2 and data["origin"]["unseen_inputs"]
    result = invoke(root, "ac", "-c", "-s", "0")
    assert "not compared: " in result.stdout and "may come in through it" in result.stdout


def test_an_index_cut_at_a_line_break_is_a_coverage_gap(built, tmp_path):
    root = copy(built, "clean", tmp_path)
    index = os.path.join(step_dir(root), "index.csv")
    lines = open(index).read().splitlines()
    open(index, "w").write("\n".join(lines[:20]) + "\n")      # whole rows, most of them gone
    code, data = as_json(root, "vc", "-s", "0")
    assert code == 2 and "op missing from the step's index" in data["coverage"]["missing"]
    assert invoke(root, "ac", "-c", "-s", "0").exit_code == 2


@pytest.mark.parametrize("broken", ["graph", "fusion"])
def test_a_broken_graph_or_fusion_file_is_exit_2_in_one_line(built, tmp_path, broken):
    root = copy(built, "clean", tmp_path)
    run = Workspace(str(root)).run("npu")
    if broken == "graph":
        graph_dir = os.path.join(run.path, "graph")
        path = os.path.join(graph_dir, os.listdir(graph_dir)[0])
        commands = [("ac", "-c"), ("vc",), ("ni", "fc1/MatMul"), ("fo",)]
    else:
        path = os.path.join(run.path, "fusion_result.json")
        commands = [("ac",), ("ac", "-c"), ("fo",)]
    open(path, "w").write('{"garbage')
    for args in commands:
        result = invoke(root, *args)
        assert result.exit_code == 2, (args, result.output)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and os.path.basename(path) in errors[0], result.stderr


def test_an_edited_compiled_graph_is_checked_although_our_dumper_wrote_it(built, tmp_path):
    """The dumper records its graph's digest so that a reader skips the structural walk of
    bytes it wrote; an edit (valid JSON, a dangling input) changes them and is caught."""
    root = copy(built, "clean", tmp_path)
    run = Workspace(str(root)).run("npu")
    graph_dir = os.path.join(run.path, "graph")
    path = os.path.join(graph_dir, os.listdir(graph_dir)[0])
    raw = open(path, "rb").read()
    assert run.info["graph_sha1"] == hashlib.sha1(raw).hexdigest()
    data = json.loads(raw)
    reader = next(n for n in data["nodes"] if n.get("inputs"))
    reader["inputs"][0] = "nowhere:0"
    open(path, "w").write(json.dumps(data))
    result = invoke(root, "vc")
    assert result.exit_code == 2 and "'nowhere'" in result.stderr, result.output


# -- 3. a non-finite NPU output against a finite golden is always a finding -------------------
def test_nan_on_the_npu_is_a_finding_whatever_the_thresholds(built):
    root = built / "overflowed"
    code, data = as_json(root, "vcs", "-l", "0", "-c", "-1", "--norm", "1e9", "--flushed", "1",
                         "--rel-error", "1e9")
    loss = [op for op in data["ops"] if op["op_name"].startswith("loss/")]
    assert code == 1 and loss and all(op["category"] == "nonfinite" for op in loss)


# -- 4. no stale answers ----------------------------------------------------------------------
def test_a_result_older_than_the_runs_is_refused_unless_named(built, tmp_path):
    root = copy(built, "clean", tmp_path)
    code, first = as_json(root, "vc", "-s", "0")
    assert code == 0
    result = invoke(root, "vcs")
    assert result.exit_code == 0 and "npu/debug_0 against cpu/debug_0, step 0" in result.stdout
    # a copy of the workspace is the same workspace (no modification time decides)
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    assert invoke(moved, "vcs").exit_code == 0
    dump(root, scale=1e5, precision_mode="force_fp16")       # newer runs, which diverge
    stale = invoke(root, "vcs")
    assert stale.exit_code == 2 and "not the newest runs" in stale.stderr
    named = invoke(root, "vcs", "-f", first["result_file"])
    assert named.exit_code == 0 and "npu/debug_0 against cpu/debug_0" in named.stdout
    assert invoke(root, "vc").exit_code == 1 and invoke(root, "vcs").exit_code == 1
    # a step dumped again under the same run: its own result is out of date, even named
    index = os.path.join(step_dir(root), "index.csv")
    with open(index, "a") as f:
        f.write(open(index).read().splitlines()[-1] + "\n")
    again = invoke(root, "vcs", "-f", first["result_file"])
    assert again.exit_code == 2 and "dumped again" in again.stderr


# -- 5. steps and runs that do not exist are errors ---------------------------------------------
def test_missing_steps_and_runs_are_errors_and_ac_takes_its_runs(built, tmp_path):
    root = copy(built, "clean", tmp_path)
    for args in (("ac", "-s", "999"), ("ac", "-c", "-s", "999"), ("vc", "-s", "999"),
                 ("pt", "fc1/BiasAdd", "-s", "999"), ("ac", "-lt", "debug_7")):
        result = invoke(root, *args)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1, args
    assert "dumped steps: 0-1" in invoke(root, "ac", "-s", "999").stderr
    assert invoke(root, "ac", "-s", "-1").exit_code == 2
    dump(root, steps=1, golden=False, precision_mode="force_fp16")   # a newer NPU run
    back = invoke(root, "ac", "-c", "-lt", "debug_0", "-rt", "cpu/debug_0", "-s", "0")
    assert back.exit_code == 0 and "npu/debug_0 against cpu/debug_0" in back.stdout
    lacking = invoke(root, "ac", "-c", "-lt", "debug_1", "-s", "1")
    assert lacking.exit_code == 2 and "npu/debug_1 has no dump of step 1" in lacking.stderr


# -- 6. interrupted dumps ---------------------------------------------------------------------
def test_an_interrupted_step_is_named_by_every_command_and_never_read(built, tmp_path):
    root = copy(built, "clean", tmp_path)
    run = Workspace(str(root)).run("npu")
    # what a killed dump leaves: the step's hidden .partial directory, and its bundle's
    last = step_dir(root, step=1)
    os.rename(last, os.path.join(os.path.dirname(last), ".1.partial"))
    bundle = os.path.join(run.path, "replay")
    os.rename(os.path.join(bundle, "1"), os.path.join(bundle, ".1.partial"))
    assert invoke(root, "vc", "-s", "0").exit_code == 0           # a result for vcs to read
    for args in (("ls",), ("ac",), ("ni", "fc1/BiasAdd"), ("pt", "fc1/BiasAdd"), ("vc", "-s", "0"),
                 ("vcs",)):
        result = invoke(root, *args)
        assert result.exit_code in (0, 1), (args, result.output)
        assert "npu/debug_0: step(s) 1 are partial (the dump was killed" in result.stderr, args
    for args in (("train", "-s", "1", "-d", "npu"), ("pt", "fc1/BiasAdd", "-s", "1")):
        result = invoke(root, *args)
        assert result.exit_code == 2 and "is partial" in result.stderr.splitlines()[-1], args


def test_ac_c_gives_no_clean_verdict_over_an_interrupted_step(built, tmp_path):
    """ac -c compares every step dumped in both runs; a step killed halfway in one run is
    not among them, so a clean answer would cover less than it claims: exit 2, the steps
    and why named in the advice, the JSON and the last line; a finding still exits 1."""
    root = copy(built, "clean", tmp_path)
    last = step_dir(root, step=1)
    os.rename(last, os.path.join(os.path.dirname(last), ".1.partial"))
    result = invoke(root, "ac", "-c")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (
        "error: no clean verdict: step(s) left out: 1 (interrupted in npu/debug_0); "
        "1 (dumped in cpu/debug_0 only)")
    assert "Not every dumped step could be compared" in result.stdout
    # the clean run is sound where it was compared, and says no more than that
    assert "precision looks sound in the steps compared" in " ".join(result.stdout.split())
    data = json.loads(invoke(root, "--json", "ac", "-c").stdout)
    assert data["verdict"] == "incomplete" and data["unseen_steps"] == {
        "interrupted in npu/debug_0": [1], "dumped in cpu/debug_0 only": [1]}
    # asked for the whole step 0 alone: complete
    assert invoke(root, "ac", "-c", "-s", "0").exit_code == 0


# -- 7. file names within 255 bytes -----------------------------------------------------------
@pytest.mark.parametrize("length", [254, 255, 256, 300])
@pytest.mark.parametrize("char", ["a", "é", "字"])
def test_every_dump_file_name_fits_in_255_bytes(length, char):
    name = (char * length).encode("utf-8")[:length].decode("utf-8", "ignore") or "x"
    for made in (layout.npu_file_name("SoftmaxV2", name, 12345, 0, 1795614770784767, "output", 0),
                 layout.npu_file_name(name, name, 1, 0, 2 ** 63 - 1, "input", 10),
                 layout.cpu_file_name(name, 0, 1795614770784767),
                 layout.fit_file_name(name, ".output.0.NCHW.npy")):
        assert len(made.encode("utf-8")) <= 255, made
    # two long names that differ only past the cut stay apart
    other = name[:-1] + "z"
    assert layout.npu_file_name("T", name, 1, 0, 1, "output", 0) != \
        layout.npu_file_name("T", other, 1, 0, 1, "output", 0)


def test_a_very_long_unicode_scope_dumps_on_both_targets(tmp_path):
    g = pt.Graph("long", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 8])
        labels = pt.placeholder("y", [None], "int32")
        with pt.name_scope("very_long_scope_" * 20):
            with pt.name_scope("ünïcødé_" * 3):
                w = pt.variable("kernel", [8, 4])
                y = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(
                    pt.ops.matmul(x, w), labels))
        train = pt.train.SGD(0.1).minimize(y)
    feeds = {x: np.ones((2, 8), np.float32), labels: np.array([1, 3], np.int32)}
    npu = pt.Session(g, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="dump", data_dir=str(tmp_path)))
    cpu = hooks.sess_dump(pt.Session(g), action="dump", data_dir=str(tmp_path))
    for sess in (npu, cpu):
        sess.run([y, train], feeds)
        sess.close()
    for dirpath, _, files in os.walk(tmp_path):
        for f in files:
            assert len(f.encode("utf-8")) <= 255, f
    assert invoke(tmp_path, "vc").exit_code == 0
    matmul = [n.name for n in g.nodes if n.type == "MatMul" and "gradients" not in n.name][0]
    assert invoke(tmp_path, "pt", matmul).exit_code == 0


# -- 8. a truncated index -----------------------------------------------------------------------
def test_an_index_cut_mid_row_is_exit_2_naming_the_row(built, tmp_path):
    root = copy(built, "clean", tmp_path)
    index = os.path.join(step_dir(root), "index.csv")
    data = open(index, "rb").read()
    last_row = data.rstrip(b"\n").rfind(b"\n") + 1
    row = data[:last_row].count(b"\n") + 1          # as the message counts: lines of the file
    # cut anywhere in the last row: in a name, in a number, right after a comma
    for cut in range(last_row + 1, len(data) - 1, 7):
        open(index, "wb").write(data[:cut])
        result = invoke(root, "vc", "-s", "0")
        assert result.exit_code == 2, cut
        assert f"index.csv is not a readable index: row {row} " in result.stderr, cut
    for args in (("ac", "-c", "-s", "0"), ("ni", "fc1/BiasAdd", "-s", "0")):
        result = invoke(root, *args)
        assert result.exit_code == 2 and "index.csv is not a readable index: row " in result.stderr


# -- 9. ni never silently shows another op ------------------------------------------------------
def test_ni_of_a_fused_op_shows_what_absorbed_it_and_a_prefix_is_no_answer(built):
    root = built / "clean"
    code, info = as_json(root, "ni", "fc1/MatMul")
    assert code == 0 and info["name"] == "fc1/BiasAdd" and info["asked"] == "fc1/MatMul"
    assert "fused into fc1/BiasAdd" in info["note"] and info["pass_name"] == "MatMulBiasAddFusionPass"
    text = invoke(root, "ni", "fc1/MatMul")
    assert "fc1/MatMul was fused into fc1/BiasAdd" in text.stdout
    prefix = invoke(root, "ni", "fc1/Mat")
    assert prefix.exit_code == 2 and "whose name holds it" in prefix.stderr


# -- 10. mapping --------------------------------------------------------------------------------
def test_two_identical_runs_compare_with_zero_error_and_cp_needs_a_golden(built, tmp_path):
    root = tmp_path / "twice"
    for _ in range(2):
        dump(root, steps=1, golden=False, precision_mode="allow_mix_precision")
    code, data = as_json(root, "vc", "-lt", "debug_1", "-rt", "npu/debug_0")
    table = pd.read_csv(data["result_file"])
    compared = table[table.Verdict == "pass"]
    assert code == 0 and len(compared) == len(table)
    assert (compared.MaxAbsoluteError == 0).all() and (compared.CosineSimilarity == 1).all()
    cast = table[table.NPUDump.str.endswith("Cast_fp16") & table.TensorIndex.str.contains(":output:")]
    assert len(cast) and (cast.GroundTruth == cast.NPUDump).all()   # a Cast against its twin
    result = invoke(root, "cp", "fc1/BiasAdd", "fc1/BiasAdd")
    assert result.exit_code == 2 and "no golden run" in result.stderr


def test_an_inserted_cast_of_a_feed_maps_to_the_feed(built):
    root = built / "overflowed"
    code, data = as_json(root, "vc", "-s", "0")
    table = pd.read_csv(data["result_file"])
    row = table[(table.NPUDump == "x/Cast_fp16") & table.TensorIndex.str.contains(":output:")]
    assert list(row.GroundTruth) == ["x"] and list(row.GoldenTensor) == ["x:0"]


# -- 11. concurrent commands report their own runs ----------------------------------------------
def test_concurrent_replays_each_report_their_own_run(built, tmp_path):
    root = copy(built, "clean", tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    procs = [subprocess.Popen([sys.executable, "-m", "precision_tool", "--data-dir", str(root),
                               *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
             for args in (["train", "-s", "0", "-d", "npu"], ["train", "-s", "0", "-d", "npu"],
                          ["--json", "fo"])]
    outs = [p.communicate(timeout=300) for p in procs]
    claimed = []
    for (out, err), p in zip(outs[:2], procs):
        assert p.returncode == 0, err
        claimed += [line.rsplit(" ", 1)[1] for line in (out + err).splitlines()
                    if "replayed into" in line]
    fo = json.loads(outs[2][0])
    claimed += [f"npu/{r}" for r in fo["runs"]]
    assert len(claimed) == len(set(claimed)) == 4
    ws = Workspace(str(root))
    kept = claimed[:2] + [f"npu/{r}" for r in fo["kept"]]      # fo deletes its bisection's
    assert fo["kept"] == fo["runs"][:1]
    for label in kept:                        # each is a replay of debug_0, as labelled
        run = ws.run(*label.split("/"))
        assert run.info.get("replay_of") == "npu/debug_0"
    # fo's first replay is the fusion-off baseline, labelled so; train's keep the original's
    assert ws.run("npu", fo["runs"][0]).info["fusion_passes"] == []
    original = ws.run("npu", "debug_0").info["fusion_passes"]
    assert original and all(ws.run(*label.split("/")).info["fusion_passes"] == original
                            for label in claimed[:2])


# -- 12. dtypes ---------------------------------------------------------------------------------
def test_bfloat16_files_strings_and_nc1hwc0_statistics(tmp_path):
    bf = tmp_path / "bf.npy"
    np.save(bf, np.array([1.5, -2.25, 3.0], dtype=ml_dtypes.bfloat16))
    code, data = as_json(tmp_path, "pt", str(bf))
    assert code == 0 and data["dtype"] == "bfloat16" and data["head"] == [1.5, -2.25, 3.0]
    strings = tmp_path / "s.npy"
    np.save(strings, np.array(["a", "b"]))
    result = invoke(tmp_path, "pt", str(strings))
    assert result.exit_code == 2 and "not a numeric tensor" in result.stderr
    assert "unpickling" not in result.stderr
    # a conv net on the NPU stores NC1HWC0 tensors: their statistics leave the padding out
    root = tmp_path / "cnn"
    dump(root, steps=1, model="cnn", golden=False)
    ws = Workspace(str(root))
    run = ws.run("npu")
    table = ws.index(run, 0)
    five = table[(table.format == "NC1HWC0") & (table.io == "output")]
    assert len(five)
    from precision_tool import numerics
    for r in five.head(4).itertuples():
        value = ws.load(run, 0, r.file)
        channels = int(str(r.original_shape).split()[1])
        real = numerics.logical_view(value, channels).astype(np.float64)
        assert np.isclose(r.mean, real.mean(), rtol=1e-5, atol=1e-7), r.op_name
        assert r.max == real.max() and r.min == real.min()
    # pt says the dtype the index says: NC1HWC0, and bfloat16 (stored as its bits)
    name = five.op_name.iloc[0]
    code, shown = as_json(root, "pt", name)
    assert shown["dtype"] == five.dtype.iloc[0]
    bf16 = tmp_path / "bf16"
    dump(bf16, steps=1, golden=False, precision_mode="allow_mix_precision_bf16")
    code, shown = as_json(bf16, "pt", "fc1/BiasAdd")
    assert code == 0 and shown["dtype"] == "bfloat16"


# -- 13. options --------------------------------------------------------------------------------
def test_negative_options_are_usage_errors_and_debug_shows_the_traceback(built, monkeypatch):
    root = built / "clean"
    for args in (("vcs", "-l", "-3"), ("ac", "-l", "-3"), ("cp", "-al", "-1", "a", "b"),
                 ("cp", "-rl", "-1", "a", "b"), ("vcs", "--norm", "-1")):
        result = invoke(root, *args)
        assert result.exit_code == 2 and "range" in result.stderr, args
    def broken(*a, **k):
        raise RuntimeError("a bug")
    monkeypatch.setattr(Workspace, "runs", broken)
    quiet = invoke(root, "ls")
    assert quiet.exit_code == 3 and quiet.stderr.strip() == "internal error: RuntimeError: a bug"
    loud = CliRunner().invoke(cli, ["--data-dir", str(root), "--log-level", "0", "ls"])
    assert loud.exit_code == 3 and "Traceback" in loud.stderr and "a bug" in loud.stderr


def test_json_of_the_script_runner_is_a_summary_of_the_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import precision_tool as pt
        from precision_tool import hooks
        m = pt.models.mlp()
        d = pt.data.digits()
        s = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(pt.SessionConfig()))
        s.run([m.loss, m.train_op], {m.x: d.x_train[:32], m.y: d.y_train[:32]})
        print("trained")
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    done = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir",
                           str(tmp_path / "ws"), "--json", "npu-dump", "--", sys.executable,
                           str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)            # the script's own output went to stderr
    assert "trained" in done.stderr and [r["run"] for r in summary["runs"]] == ["npu/debug_0"]
    assert summary["runs"][0]["steps"] == [0]
    import dataclasses
    from precision_tool.analysis.diagnosis.overflow import DumpedRun, ScriptDumps
    assert set(summary) == {f.name for f in dataclasses.fields(ScriptDumps)} | {"overflowing_kernels"}
    assert set(summary["runs"][0]) == {f.name for f in dataclasses.fields(DumpedRun)}


# -- properties ---------------------------------------------------------------------------------
SPECIAL = [np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0, -65504.0, 1e30, -1e30, 1e-8, 1.0]
values = st.lists(st.one_of(st.sampled_from(SPECIAL),
                            st.floats(-1e6, 1e6, allow_nan=False, width=32)),
                  min_size=8, max_size=8)


@pytest.fixture(scope="module")
def one_op(tmp_path_factory):
    """A workspace of a one-op graph (Relu of a [2, 4] feed) on both targets."""
    root = tmp_path_factory.mktemp("one_op")
    g = pt.Graph("one", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [2, 4])
        y = pt.ops.relu(x, name="act")
    npu = pt.Session(g, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="force_fp32"), action="dump", data_dir=str(root)))
    cpu = hooks.sess_dump(pt.Session(g), action="dump", data_dir=str(root))
    for sess in (npu, cpu):
        sess.run([y], {x: np.ones((2, 4), np.float32)})
        sess.close()
    return root


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(npu=values, golden=values)
def test_special_values_never_crash_and_show_the_same_metrics_everywhere(one_op, tmp_path_factory,
                                                                         npu, golden):
    root = tmp_path_factory.mktemp("special")
    shutil.rmtree(root)
    shutil.copytree(one_op, root)
    ws = Workspace(str(root))
    paths = {}
    for target, data in (("npu", npu), ("cpu", golden)):
        run = ws.run(target)
        table = ws.index(run, 0)
        row = table[(table.op_name == "act") & (table.io == "output")].iloc[0]
        paths[target] = os.path.join(ws.step_path(run, 0), row.file)
        value = np.array(data, np.float32).reshape(2, 4)
        np.save(paths[target], value)
        recorded_as(ws.step_path(run, 0), row.file, value)
    want = compare_tensors(np.load(paths["npu"]), np.load(paths["cpu"]))
    code, vc = as_json(root, "vc")
    assert code in (0, 1)
    rows = pd.read_csv(vc["result_file"], keep_default_na=False, na_values=["nan", ""])
    row = rows[(rows.NPUDump == "act") & rows.TensorIndex.str.contains(":output:")].iloc[0]
    code, cp = as_json(root, "cp", paths["npu"], paths["cpu"])
    assert code in (0, 1)
    for key in ("CosineSimilarity", "MaxAbsoluteError", "RootMeanSquareError", "NpuNanCount",
                "NpuInfCount", "NpuNorm", "GoldenNorm"):
        w = want[key]
        shown = cp["metrics"][key]
        if w != w:
            assert shown == "nan" and row[key] != row[key], key
        else:
            assert shown == w and row[key] == pytest.approx(w, rel=1e-15, abs=0), key
    for args in (("vcs", "-l", "0"), ("ac", "-c"), ("pt", paths["npu"]), ("pt", "act")):
        assert invoke(root, *args).exit_code in (0, 1), args
    # a non-finite NPU element the golden lacks is a finding, whatever else
    nonfinite = lambda v: sum(1 for a in v if a != a or abs(a) == np.inf)  # noqa: E731
    if nonfinite(npu) > nonfinite(golden):
        assert invoke(root, "vcs", "-l", "0", "-c", "-1").exit_code == 1


@settings(max_examples=max(EXAMPLES // 3, 5), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workspace=st.sampled_from(["clean", "overflowed"]),
       damage=st.sampled_from(["delete", "graph", "index", "fusion"]),
       k=st.integers(1, 6), seed=st.integers(0, 2 ** 16))
def test_damage_to_a_workspace_never_exits_0(built, tmp_path_factory, workspace, damage, k, seed):
    root = tmp_path_factory.mktemp("damaged")
    shutil.rmtree(root)
    shutil.copytree(built / workspace, root)
    rng = np.random.default_rng(seed)
    run = Workspace(str(root)).run("npu")
    target = rng.choice(["npu", "cpu"]) if damage in ("delete", "index") else "npu"
    directory = step_dir(root, target)
    if damage == "delete":
        files = sorted(f for f in os.listdir(directory) if f.endswith(".npy"))
        for f in rng.choice(files, size=min(k, len(files)), replace=False):
            os.remove(os.path.join(directory, f))
    elif damage == "index":
        path = os.path.join(directory, "index.csv")
        data = open(path, "rb").read()
        open(path, "wb").write(data[:int(len(data) * rng.uniform(0.1, 0.95))])
    else:
        if damage == "graph":
            graph_dir = os.path.join(run.path, "graph")
            path = os.path.join(graph_dir, os.listdir(graph_dir)[0])
        else:
            path = os.path.join(run.path, "fusion_result.json")
        data = open(path, "rb").read()
        open(path, "wb").write(data[:int(len(data) * rng.uniform(0.0, 0.9))])
    for args in (("ac", "-c", "-s", "0"), ("vc", "-s", "0")):
        if damage == "fusion" and args[0] == "vc":
            continue                # vc reads no fusion file
        result = invoke(root, *args)
        assert result.exit_code != 0, (args, damage, result.output)
        assert "sound" not in result.stdout


# -- a foreign dump the tool can read nothing of, or only some of --------------------------------
def _foreign(root, npu_files):
    step = root / "npu" / "debug_0" / "dump" / "20240101000000" / "0" / "ge_default" / "1" / "0"
    step.mkdir(parents=True)
    for name in npu_files:
        np.save(step / name, np.ones((2, 3), np.float32))
    (step / "notes.txt").write_text("not a tensor")
    golden = root / "cpu" / "debug_0" / "dump" / "0"
    golden.mkdir(parents=True)
    np.save(golden / "fc1_MatMul.0.1700000000000001.npy", np.ones((2, 3), np.float32))


def test_a_compare_that_saw_nothing_is_never_sound(tmp_path):
    """An Ascend-named NPU step none of whose files the tool recognises: vc and ac -c say
    nothing was compared and exit 2, never 'precision looks sound' with 0 of 0 compared."""
    _foreign(tmp_path, [])
    vc = invoke(tmp_path, "vc")
    assert vc.exit_code == 2 and "0 of 0 tensors compared" in vc.stderr
    ac = invoke(tmp_path, "ac", "-c")
    assert ac.exit_code == 2 and "looks sound" not in ac.stdout
    assert "Nothing could be compared" in ac.stdout
    code, payload = as_json(tmp_path, "ac", "-c")
    assert code == 2 and payload["verdict"] == "incomplete"


def test_an_ascend_named_dump_is_compared_by_its_output_tensors(tmp_path):
    """Its outputs are their ops' tensors (the file names say which); an input file's name
    does not say which tensor it holds: that row is no golden tensor's, and says so."""
    _foreign(tmp_path, ["MatMul.fc1_MatMul.12.0.1700000000000001.output.0.npy",
                        "MatMul.fc1_MatMul.12.0.1700000000000001.input.0.npy"])
    code, payload = as_json(tmp_path, "vc")
    assert code == 0 and payload["verdicts"] == {"pass": 1, "npu-only": 1}


@pytest.mark.parametrize("npu_layers, golden_layers", [(1, 2), (2, 1)])
def test_runs_of_different_graphs_get_no_verdict_and_name_what_has_no_counterpart(
        tmp_path, npu_layers, golden_layers):
    """A 1-layer NPU run against a 2-layer golden share the names of layer 0: compared on
    those alone they looked whole, and ac -c gave a verdict on the whole. Every op of either
    run without a counterpart in the other is now a gap that the compare names, and the
    commands exit 2; the other way round, the NPU's extra ops have no golden tensor."""
    from scenarios import different_graphs
    root = str(tmp_path)
    different_graphs(root, npu_layers, golden_layers)
    for args in (("vc",), ("ac", "-c")):
        result = invoke(root, *args)
        assert result.exit_code == 2, (args, result.output)
        last = result.stderr.splitlines()[-1]
        assert "incomplete" in last and "encoder/layer_1/" in last, last
        expected = "no counterpart in the compared graph" if golden_layers > npu_layers \
            else "no golden tensor"
        assert expected in last, last
