"""Hostile and broken inputs, tried systematically (hypothesis) through the library and the
command line: the answer is a PrecisionToolError, a documented exit code with one line on
stderr, or a result row marked with its reason; never a traceback, a hang or other code run.
The number of examples per category is PRECISION_TOOL_FUZZ_EXAMPLES (25 by default)."""
import ast
import json
import os
import pathlib
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import precision_tool as pt
from harness import dump_both
from precision_tool import analysis
from precision_tool.analysis.comparing.metrics import compare_tensors
from precision_tool.cli import main
from precision_tool.dump import Workspace

EXAMPLES = int(os.environ.get("PRECISION_TOOL_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A small workspace with an NPU and a golden dump of one MLP step."""
    root = str(tmp_path_factory.mktemp("pristine"))
    m = pt.models.mlp(hidden=(8,))
    d = pt.data.digits()
    dump_both(root, m.graph, [m.loss, m.train_op], {m.x: d.x_train[:4], m.y: d.y_train[:4]})
    return root


_copies = [0]


def _copy(pristine, tmp_path):
    _copies[0] += 1
    dest = str(tmp_path / f"ws{_copies[0]}")
    shutil.copytree(pristine, dest, symlinks=True)
    return dest


def run_cli(capsys, *argv):
    """Exit code and stderr of a one-shot command; asserts the error contract."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err + out, err
    if code == 2:       # one line of reason (progress notes may precede it)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    return code, err


def _npu_step(ws):
    run = ws.run("npu")
    return run, ws.step_path(run, 0), ws.index(run, 0)


# -- 1. broken tensor files -------------------------------------------------------------------
MUTATIONS = ["truncate", "flip_header", "zero_bytes", "directory", "symlink_loop", "pickled",
             "huge_shape", "random_bytes", "fortran_object"]


def _mutate(path, kind, k, blob):
    raw = pathlib.Path(path).read_bytes()
    os.remove(path)
    if kind == "truncate":
        pathlib.Path(path).write_bytes(raw[:k % len(raw)])
    elif kind == "flip_header":
        pos = 8 + k % 100
        pathlib.Path(path).write_bytes(raw[:pos] + bytes([raw[pos] ^ 0x5A]) + raw[pos + 1:])
    elif kind == "zero_bytes":
        pathlib.Path(path).write_bytes(b"")
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "symlink_loop":
        os.symlink(path, path)
    elif kind == "pickled":
        np.save(path, np.array([{"x": k}], dtype=object), allow_pickle=True)
    elif kind == "huge_shape":
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False,
                                                     "shape": (2 ** 40 + k,)})
            f.write(b"\0" * 64)
    elif kind == "random_bytes":
        pathlib.Path(path).write_bytes(blob)
    else:  # an object header with no pickle behind it
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": True,
                                                     "shape": (3,)})
            f.write(blob)


@FUZZ
@given(kind=st.sampled_from(MUTATIONS), k=st.integers(0, 10 ** 6),
       blob=st.binary(max_size=300), which=st.integers(0, 10 ** 6))
def test_broken_tensor_files_are_refused_or_marked_never_crash(pristine, tmp_path, capsys,
                                                               kind, k, blob, which):
    root = _copy(pristine, tmp_path)
    ws = Workspace(root)
    run, step_dir, table = _npu_step(ws)
    files = sorted(set(f for f in table.file if f))
    victim = files[which % len(files)]
    _mutate(os.path.join(step_dir, victim), kind, k, blob)
    ws = Workspace(root)
    with pytest.raises(pt.PrecisionToolError):
        ws.load(ws.run("npu"), 0, victim)
    result = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    rows = result[result.TensorIndex.isin(
        [f"{r.op_name}:{r.io}:{r.index}" for r in table.itertuples() if r.file == victim])]
    mapped = rows[rows.Verdict != "npu-only"]
    assert (mapped.Verdict == "error").all() and \
        mapped.CompareFailReason.str.startswith("unreadable: ").all()
    code, err = run_cli(capsys, "--data-dir", root, "pt", os.path.join(step_dir, victim))
    assert code == 2
    run_cli(capsys, "--data-dir", root, "vc")
    run_cli(capsys, "--data-dir", root, "ni", table.op_name.iloc[0])


# -- 2. a broken index.csv --------------------------------------------------------------------
@FUZZ
@given(kind=st.sampled_from(["drop_rows", "duplicate_rows", "garbage_line", "no_header",
                             "random_bytes", "empty", "missing_file", "extra_columns"]),
       blob=st.binary(max_size=200), k=st.integers(0, 1000))
def test_a_broken_index_is_an_error_or_a_marked_row(pristine, tmp_path, capsys, kind, blob, k):
    root = _copy(pristine, tmp_path)
    _, step_dir, table = _npu_step(Workspace(root))
    index = os.path.join(step_dir, "index.csv")
    lines = pathlib.Path(index).read_text(encoding="utf-8").splitlines()
    if kind == "drop_rows":
        lines = lines[:1] + lines[1 + k % (len(lines) - 1):]
    elif kind == "duplicate_rows":
        lines = lines + lines[1:1 + k % 5]
    elif kind == "garbage_line":
        lines.insert(1 + k % (len(lines) - 1), blob.decode("latin1").replace("\n", " "))
    elif kind == "no_header":
        lines = lines[1:]
    elif kind == "extra_columns":
        lines = [line + ",x,y" for line in lines]
    elif kind == "missing_file":
        os.remove(os.path.join(step_dir, sorted(f for f in table.file if f)[k % len(table)
                                                                            % len(set(table.file))]))
    text = "\n".join(lines) + "\n"
    if kind == "random_bytes":
        pathlib.Path(index).write_bytes(blob)
    elif kind == "empty":
        pathlib.Path(index).write_bytes(b"")
    else:
        pathlib.Path(index).write_text(text, encoding="utf-8")
    ws = Workspace(root)
    try:
        ws.index(ws.run("npu"), 0)
    except pt.PrecisionToolError:
        pass
    for argv in (["vc"], ["ls"], ["ac"], ["vcs"]):
        run_cli(capsys, "--data-dir", root, *argv)


# -- 3. op names that could escape or break file names ----------------------------------------
NAME_PARTS = st.sampled_from(["..", "../..", "/", "\\", "a/b", "..\\..", "\x00", " ", ".",
                              "ünïcødé", "名前", "😀", "x" * 300, "%s", "$(id)", "'", '"',
                              ",", "\n", "CON", "-rf"])


@FUZZ
@given(parts=st.lists(NAME_PARTS, min_size=1, max_size=4))
def test_op_names_never_escape_the_workspace(tmp_path, capsys, parts):
    name = "".join(parts)
    root = str(tmp_path / f"names{abs(hash(name))}")
    g = pt.Graph("names", seed=0)
    try:
        with g.as_default():
            x = pt.placeholder("x", [2])
            y = pt.ops.mul(x, 2.0, name=name)
    except pt.PrecisionToolError:
        return                               # refused with a reason: fine
    dump_both(root, g, y, {x: np.ones(2, np.float32)})
    real_root = os.path.realpath(root)
    for dirpath, dirs, files in os.walk(root):
        for f in files + dirs:
            assert os.path.realpath(os.path.join(dirpath, f)).startswith(real_root + os.sep)
    ws = Workspace(root)
    assert y.node.name in set(ws.index(ws.run("npu"), 0).op_name)
    assert y.node.name in set(ws.index(ws.run("cpu"), 0).op_name)
    result = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    assert (result[result.NPUDump == y.node.name].Verdict == "pass").all()
    run_cli(capsys, "--data-dir", root, "ni", y.node.name)


# -- 4. graph JSON ----------------------------------------------------------------------------
def _graph_json():
    m = pt.models.mlp(hidden=(4,))
    return json.loads(pt.graph.graph_to_json(m.graph))


@FUZZ
@given(kind=st.sampled_from(["text", "cycle", "unknown_op", "dangling", "wrong_types",
                             "missing_key", "deep"]),
       blob=st.text(max_size=200), k=st.integers(0, 1000))
def test_bad_graph_json_is_refused_with_a_reason(tmp_path, capsys, pristine, kind, blob, k):
    data = _graph_json()
    nodes = data["nodes"]
    node = nodes[1 + k % (len(nodes) - 1)]
    if kind == "cycle":
        nodes[0]["inputs"] = [f"{nodes[-1]['name']}:0"]
        node["inputs"] = [f"{node['name']}:0"] + node.get("inputs", [])[1:]
    elif kind == "unknown_op":
        node["type"] = "NoSuchOp" + blob[:10]
    elif kind == "dangling":
        node["inputs"] = ["nowhere:0"]
    elif kind == "wrong_types":
        node["inputs"] = 42
    elif kind == "missing_key":
        node.pop("type", None)
    text = blob if kind == "text" else "[" * 10000 if kind == "deep" else json.dumps(data)
    path = tmp_path / f"g{k}.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(pt.PrecisionToolError):
        pt.load_graph(str(path))
    code, _ = run_cli(capsys, "--data-dir", pristine, "vc", "-g", str(path))
    assert code == 2


# -- 5. numbers: nan, inf, empty, scalars, mismatches -----------------------------------------
F32_MAX = float(np.finfo(np.float32).max)
# the huge values a saturating device writes: float32's and float16's maxima and their
# neighbours (KL's normalisation crashed on a side of float32 maxima), not only 1e30
HUGE = [F32_MAX, -F32_MAX, float(np.nextafter(np.float32(F32_MAX), np.float32(0))), 65504.0,
        -65504.0, 65488.0, 65520.0]
FLOATS = st.sampled_from([0.0, -0.0, 1.0, -1e-30, 1e30, np.nan, np.inf, -np.inf, 3.5] + HUGE)


@FUZZ
@given(x=st.lists(FLOATS, max_size=12), y=st.lists(FLOATS, max_size=12),
       dtype=st.sampled_from([np.float16, np.float32, np.float64]),
       scalar=st.booleans())
def test_metrics_are_defined_for_every_pair(x, y, dtype, scalar):
    with np.errstate(over="ignore"):
        a = np.array(x[0] if scalar and x else x, dtype=dtype)
        b = np.array(y[0] if scalar and y else y, dtype=np.float32)
    row = compare_tensors(a, b)
    from precision_tool.analysis.comparing.verdicts import verdict
    assert verdict(row) in ("pass", "fail", "nonfinite", "error")
    cos = row["CosineSimilarity"]
    assert cos != cos or -1.0 <= cos <= 1.0
    kl = row["KullbackLeiblerDivergence"]
    assert kl != kl or kl >= 0.0
    if a.shape != b.shape:
        assert row["CompareFailReason"].startswith("shape mismatch")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_side_saturated_at_its_maximum_compares_with_a_kl(dtype, sign):
    """A tensor saturated at its dtype's maximum against an ordinary one: KL's sums then
    differ by 40 orders of magnitude, and math.log1p of a u rounded to -1 raised; the KL is
    the textbook sum P log(P / Q) of the min-max normalised sides (float64 reference)."""
    top = float(np.finfo(dtype).max)
    rng = np.random.default_rng(3)
    a = np.full(1000, sign * top, dtype)
    b = rng.standard_normal(1000).astype(np.float32)
    row = compare_tensors(a, b)
    x = a.astype(np.float64)
    y = b.astype(np.float64)
    px = np.maximum(x, np.finfo(np.float32).eps)          # lo == hi: the values themselves
    qy = np.maximum((y - y.min()) / (y.max() - y.min()), np.finfo(np.float32).eps)
    P, Q = px / px.sum(), qy / qy.sum()
    expected = float(np.sum(P * np.log(P / Q)))
    # (the tool normalises a float32 side in float32: agreement to about 1e-7)
    assert row["KullbackLeiblerDivergence"] == pytest.approx(expected, rel=1e-6)


# -- 6. half a workspace ----------------------------------------------------------------------
@pytest.mark.parametrize("missing", ["cpu", "npu", "both"])
def test_a_workspace_without_one_side_is_one_line(pristine, tmp_path, capsys, missing):
    root = _copy(pristine, tmp_path)
    for side in (["cpu", "npu"] if missing == "both" else [missing]):
        shutil.rmtree(os.path.join(root, side))
    for argv in (["vc"], ["vcs"], ["ac", "-c"], ["ls"], ["fo"], ["ni", "fc1/MatMul"]):
        code, err = run_cli(capsys, "--data-dir", root, *argv)
        needs_it = argv[0] in ("vc", "vcs", "fo") or (argv[0] == "ac" and missing != "cpu")
        if needs_it:                 # the others show what is there
            assert code == 2 and ("no " in err or "has no" in err), (argv, err)


# -- 7. configuration files -------------------------------------------------------------------
@FUZZ
@given(text=st.text(max_size=200), kind=st.sampled_from(["fusion_switch", "mixlist"]))
def test_malformed_config_files_are_refused_with_a_reason(tmp_path, text, kind):
    path = tmp_path / f"{kind}.cfg"
    path.write_text(text, encoding="utf-8")
    m = pt.models.mlp(hidden=(4,))
    cfg = (pt.SessionConfig(fusion_switch_file=str(path)) if kind == "fusion_switch" else
           pt.SessionConfig(precision_mode="allow_mix_precision", modify_mixlist=str(path)))
    try:
        pt.Session(m.graph, target="npu", config=cfg)
    except pt.PrecisionToolError as e:
        assert str(e) and "\n" not in str(e)


# -- 8. no code from data ---------------------------------------------------------------------
SOURCE = pathlib.Path(pt.__file__).parent


def test_no_unpickling_eval_or_exec_anywhere_in_the_package():
    """Data never becomes code: no allow_pickle=True, no pickle/marshal/shelve import, no
    eval/exec/compile call, no yaml.load, anywhere in the package (the Dask engine's own
    transport is Dask's, between our processes, not from a dump)."""
    found = []
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                if {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle"} & \
                        {n.split(".")[0] for n in names}:
                    found.append(f"{path.name}:{node.lineno} imports {names}")
            elif isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                if name in ("eval", "exec", "compile", "__import__") and isinstance(fn, ast.Name):
                    found.append(f"{path.name}:{node.lineno} calls {name}")
                for kw in node.keywords:
                    if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant)
                                                         and kw.value.value is False):
                        found.append(f"{path.name}:{node.lineno} allow_pickle={ast.unparse(kw.value)}")
                if name == "load" and isinstance(fn, ast.Attribute) and \
                        getattr(fn.value, "id", "") in ("yaml", "pickle"):
                    found.append(f"{path.name}:{node.lineno} {fn.value.id}.load")
    assert found == []


def test_every_np_load_in_the_package_refuses_pickles():
    calls = []
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "load" and getattr(node.func.value, "id", "") == "np":
                ok = any(kw.arg == "allow_pickle" and isinstance(kw.value, ast.Constant)
                         and kw.value.value is False for kw in node.keywords)
                calls.append((f"{path.name}:{node.lineno}", ok))
    assert calls and all(ok for _, ok in calls), calls
