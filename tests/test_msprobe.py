"""msprobe's dumps read as runs: the .pt reader (against torch.load), the dump.json index
(hand-written dumps for each bad input, MindSpore's .npy layout), and real dumps made here
by mindstudio-probe's own debugger, of the simulated NPU and of plain CPU runs, against
msprobe's own compare."""
import glob
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
import zlib

import numpy as np
import pytest
from click.testing import CliRunner

from precision_tool.analysis.comparing.compare import compare_step
from precision_tool.cli import cli
from precision_tool.dump import Workspace
from precision_tool.dump.formats import msprobe
from precision_tool.dump.formats.npy import read_tensor_file
from precision_tool.errors import WorkspaceError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "msprobe_attention.py")


def invoke(*args, data_dir):
    return CliRunner().invoke(cli, ["--data-dir", str(data_dir), *map(str, args)])


# -- .pt files ----------------------------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch", reason="torch.save makes the .pt files "
                                               "(pip install 'precision_tool[torch]')")


def test_pt_reader_matches_torch_load(tmp_path):
    torch = _torch()
    g = torch.Generator().manual_seed(0)
    cases = {
        "f32": torch.randn(3, 4, generator=g),
        "transposed": torch.randn(4, 5, generator=g).t(),
        "view_with_offset": torch.arange(20.0)[5:11].view(2, 3),
        "bf16": torch.randn(6, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, generator=g).half(),
        "f64": torch.randn(3, generator=g).double(),
        "i64": torch.arange(5), "i32": torch.arange(4, dtype=torch.int32),
        "bool": torch.tensor([True, False, True]), "u8": torch.arange(3, dtype=torch.uint8),
        "empty": torch.empty(0, 3), "scalar": torch.tensor(3.5),
        "expanded": torch.randn(3, 1, generator=g).expand(3, 4),
        "parameter": torch.nn.Parameter(torch.randn(2, generator=g)),
        "big": torch.randn(300, 300, generator=g),
    }
    for name, t in cases.items():
        path = str(tmp_path / f"{name}.pt")
        torch.save(t, path)
        want = torch.load(path, weights_only=True).detach()
        for mmap_over in (None, 0):        # read, and mapped
            got = read_tensor_file(path, mmap_over=mmap_over)
            assert got.shape == tuple(want.shape), name
            assert str(got.dtype) == str(want.dtype).replace("torch.", ""), name
            ref = want.double().numpy() if want.dtype == torch.bfloat16 else want.numpy()
            np.testing.assert_array_equal(got.astype(np.float64), ref.astype(np.float64))


def _zip_with_pickle(path, payload: bytes):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")


class _Runs:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_pt_whose_pickle_asks_for_more_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    _zip_with_pickle(path, pickle.dumps(_Runs(f"touch {marker}"), protocol=2))
    with pytest.raises(WorkspaceError, match=r"evil\.pt is refused: its pickle asks for "
                                             r"(posix|os)\.system"):
        read_tensor_file(str(path))
    assert not marker.exists()
    _zip_with_pickle(path, pickle.dumps({"not": "a tensor"}, protocol=2))
    with pytest.raises(WorkspaceError, match="holds a dict, not a tensor"):
        read_tensor_file(str(path))


def test_pt_saved_with_a_later_pickle_protocol_reads_the_same(tmp_path):
    torch = _torch()
    t = torch.arange(12.0).view(3, 4).t()
    for protocol in (2, 4, 5):
        path = str(tmp_path / f"p{protocol}.pt")
        torch.save(t, path, pickle_protocol=protocol)
        np.testing.assert_array_equal(read_tensor_file(path), t.numpy())


def test_every_damaged_byte_of_a_pt_is_an_error_or_a_tensor(tmp_path):
    """A flipped byte anywhere in the file: a tensor (the byte was in the data) or one
    WorkspaceError, never another exception, never code run."""
    torch = _torch()
    good = tmp_path / "good.pt"
    torch.save(torch.arange(6.0).view(2, 3), good, _use_new_zipfile_serialization=True)
    raw = bytearray(good.read_bytes())
    bad = tmp_path / "bad.pt"
    errors = 0
    for k in range(0, len(raw), 3):
        for flip in (0x01, 0x80):
            damaged = bytearray(raw)
            damaged[k] ^= flip
            bad.write_bytes(bytes(damaged))
            try:
                got = read_tensor_file(str(bad))
                assert isinstance(got, np.ndarray)
            except WorkspaceError as e:
                errors += 1
                assert "\n" not in str(e)
    assert errors > 0


def test_damaged_pt_files_say_what_is_wrong(tmp_path):
    torch = _torch()
    good = tmp_path / "good.pt"
    torch.save(torch.arange(16.0), good)
    raw = good.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(WorkspaceError, match=r"cut\.pt is corrupt: not a torch.save archive"):
        read_tensor_file(str(cut))
    # a storage shorter than the pickle says (a member rewritten by hand)
    short = tmp_path / "short.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(short, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, data[:32] if info.filename.endswith("/data/0") else data)
    with pytest.raises(WorkspaceError, match=r"its storage holds 32 bytes, the pickle says 16 x 4"):
        read_tensor_file(str(short))
    not_zip = tmp_path / "text.pt"
    not_zip.write_text("hello")
    with pytest.raises(WorkspaceError, match="not a torch.save archive"):
        read_tensor_file(str(not_zip))


# -- hand-written dumps -------------------------------------------------------------------------
def _tensor(a, name=None, md5=None):
    a = np.asarray(a)
    entry = {"type": "mindspore.Tensor", "dtype": str(a.dtype), "shape": list(a.shape),
             "Max": float(a.max()), "Min": float(a.min()), "Mean": float(a.mean()),
             "Norm": float(np.linalg.norm(a.astype(np.float64)))}
    if name:
        entry["data_name"] = name
    if md5:
        entry["md5"] = md5
    return entry


def write_dump(root, calls, task="tensor", step=0, rank="rank0", framework="mindspore"):
    """A dump in msprobe's layout: calls is [(call, inputs, outputs)] of numpy arrays; a
    tensor dump stores each as .npy (MindSpore's format), a statistics one only its
    statistics, an md5 one its statistics and CRC32."""
    where = os.path.join(root, f"step{step}", rank)
    os.makedirs(os.path.join(where, "dump_tensor_data"), exist_ok=True)
    data = {}
    for call, ins, outs in calls:
        record = {"input_args": [], "input_kwargs": {}, "output": []}
        for io_, arrays, key in (("input", ins, "input_args"), ("output", outs, "output")):
            for k, a in enumerate(arrays):
                a = np.ascontiguousarray(a)
                name = f"{call}.{io_}.{k}.npy" if task == "tensor" else None
                if name:
                    np.save(os.path.join(where, "dump_tensor_data", name), a)
                md5 = f"{zlib.crc32(a.tobytes()):08x}" if task == "md5" else None
                record[key].append(_tensor(a, name, md5))
        data[call] = record
    with open(os.path.join(where, "dump.json"), "w") as f:
        json.dump({"task": "statistics" if task == "md5" else task, "level": "L1",
                   "framework": framework, "dump_data_dir": None, "data": data}, f)
    return where


def _model(scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    h = x @ w
    r = np.maximum(h * scale, 0)
    return [("Mint.matmul.0.forward", [x, w], [h]),
            ("Mint.mul.0.forward", [h], [h * scale]),
            ("Functional.relu.0.forward", [h * scale], [r]),
            ("Tensor.sum.0.forward", [r], [np.float32(r.sum()).reshape(())])]


def test_a_tensor_dump_indexes_every_tensor_and_links_inputs(tmp_path):
    where = write_dump(tmp_path / "d", _model())
    table = msprobe.read_index(where, "device")
    rows = table.records()
    assert [r["op_name"] for r in rows if r["io"] == "output"] == \
        ["Mint.matmul.0.forward", "Mint.mul.0.forward", "Functional.relu.0.forward",
         "Tensor.sum.0.forward"]
    by = {(r["op_name"], r["io"], r["index"]): r for r in rows}
    # what an input is: the output whose statistics it has, else a name of its own
    assert by[("Mint.mul.0.forward", "input", 0)]["tensor"] == "Mint.matmul.0.forward:0"
    assert by[("Functional.relu.0.forward", "input", 0)]["tensor"] == "Mint.mul.0.forward:0"
    assert by[("Mint.matmul.0.forward", "input", 1)]["tensor"] == "Mint.matmul.0.forward.input.1"
    assert by[("Mint.matmul.0.forward", "output", 0)]["file"] == \
        "dump_tensor_data/Mint.matmul.0.forward.output.0.npy"
    assert by[("Mint.matmul.0.forward", "output", 0)]["op_type"] == "Mint.matmul"


def test_vc_on_dump_directories_compares_and_finds_the_planted_op(tmp_path):
    write_dump(tmp_path / "golden", _model())
    write_dump(tmp_path / "device", _model(scale=-1.0))     # the mul flips the sign
    ws = tmp_path / "ws"
    out = invoke("ac", "-c", "-lt", tmp_path / "device", "-rt", tmp_path / "golden",
                 data_dir=ws)
    assert out.exit_code == 1, out.output
    assert "Root cause" in out.output and "Mint.mul.0.forward" in out.output
    # the runs it made, by reference; made once
    again = invoke("--json", "import", tmp_path / "device", data_dir=ws)
    assert again.exit_code == 0, again.output
    runs = json.loads(again.stdout)["runs"]
    assert [r["run"] for r in runs] == ["npu/debug_0"]
    assert runs[0]["source"] == os.path.realpath(tmp_path / "device")
    assert os.listdir(ws / "npu") == ["debug_0"]


def test_a_relu_whose_mask_flips_on_a_device_dump_is_no_origin(tmp_path):
    """A device dump whose activation carries rounding noise (cosine 0.99657, a pass) into
    a ReLU whose output falls to 0.9717: values near zero crossed the mask. The ReLU rounds
    nothing (an exact call by its name, sums.EXACT_CALLS, as a script's ReluGrad kernel
    is), so ac -c calls it gradual and names no origin (exit 0); before, it named
    Functional.relu.0.forward the root cause."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal(4096).astype(np.float32) - 1.5
    noisy = h + 0.15 * rng.standard_normal(4096).astype(np.float32)
    x = h + 1.5

    def calls(a):
        return [("Tensor.sub.0.forward", [x], [a]),
                ("Functional.relu.0.forward", [a], [np.maximum(a, 0)])]
    write_dump(tmp_path / "golden", calls(h))
    write_dump(tmp_path / "device", calls(noisy))
    out = invoke("--json", "ac", "-c", "-lt", tmp_path / "device", "-rt", tmp_path / "golden",
                 data_dir=tmp_path / "ws")
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    assert r["origin"] is None and r["gradual"]["first"]["op_name"] == "Functional.relu.0.forward"
    assert r["gradual"]["first"]["input_cosine"] >= 0.98 > r["gradual"]["first"]["output_cosine"]


def test_statistics_and_md5_dumps_are_compared_by_what_they_hold(tmp_path):
    for task in ("statistics", "md5"):
        write_dump(tmp_path / task / "g", _model(), task=task)
        write_dump(tmp_path / task / "n", _model(), task=task)
        ws = Workspace(str(tmp_path / task / "ws"))
        npu, gold = ws.imported(str(tmp_path / task / "n"), "npu")[0], \
            ws.imported(str(tmp_path / task / "g"), "cpu")[0]
        table = compare_step(ws, npu, gold, 0)
        reasons = set(table["CompareFailReason"].tolist())
        want = "statistics only (md5 equal: the same bits)" if task == "md5" \
            else "statistics only"
        assert reasons == {want}, reasons
        assert set(table["Verdict"].tolist()) == {"pass"}


def test_a_tensor_whose_crc_disagrees_with_the_dump_is_not_compared(tmp_path):
    calls = _model()
    where = write_dump(tmp_path / "n", calls, task="tensor")
    write_dump(tmp_path / "g", calls, task="tensor")
    # a tensor dump that also recorded each tensor's CRC32, one file changed after it
    path = os.path.join(where, "dump.json")
    dump = json.load(open(path))
    out = dump["data"]["Mint.mul.0.forward"]["output"][0]
    out["md5"] = f"{zlib.crc32(np.ascontiguousarray(calls[1][2][0]).tobytes()):08x}"
    json.dump(dump, open(path, "w"))
    np.save(os.path.join(where, "dump_tensor_data", "Mint.mul.0.forward.output.0.npy"),
            calls[1][2][0] + 1)
    result = invoke("vc", "-lt", tmp_path / "n", "-rt", tmp_path / "g", data_dir=tmp_path / "ws")
    assert result.exit_code == 2, result.output
    assert "1 unreadable (CRC32 differs from the dump's) (Mint.mul.0.forward)" in result.output
    ws = Workspace(str(tmp_path / "ws"))
    table = compare_step(ws, ws.run("npu"), ws.run("cpu"), 0)
    reasons = [r for r in table["CompareFailReason"].tolist() if r]
    assert len(reasons) == 1 and "does not hold what was dumped: its CRC32 is" in reasons[0]


@pytest.mark.parametrize("damage, message", [
    ("cut", "msprobe dump .*dump.json is not valid JSON"),
    ("empty", "holds no call: the dump was on while nothing it watches ran"),
    ("task", "has task 'overflow_check': this tool reads tensor, statistics, md5 dumps"),
    ("escape", "names the file '../../x.npy', which is not a file of dump_tensor_data/"),
])
def test_a_damaged_dump_json_is_one_line_and_exit_2(tmp_path, damage, message):
    where = write_dump(tmp_path / "n", _model())
    write_dump(tmp_path / "g", _model())
    path = os.path.join(where, "dump.json")
    text = open(path).read()
    dump = json.loads(text)
    if damage == "cut":
        open(path, "w").write(text[:len(text) // 2])
    else:
        if damage == "empty":
            dump["data"] = {}
        elif damage == "task":
            dump["task"] = "overflow_check"
        else:
            dump["data"]["Mint.mul.0.forward"]["output"][0]["data_name"] = "../../x.npy"
        json.dump(dump, open(path, "w"))
    out = invoke("vc", "-lt", tmp_path / "n", "-rt", tmp_path / "g", data_dir=tmp_path / "ws")
    assert out.exit_code == 2, out.output
    assert re.search(message, out.output), out.output
    assert "Traceback" not in out.output


def test_a_missing_tensor_file_makes_the_compare_incomplete_never_sound(tmp_path):
    where = write_dump(tmp_path / "n", _model())
    write_dump(tmp_path / "g", _model())
    os.remove(os.path.join(where, "dump_tensor_data", "Mint.mul.0.forward.output.0.npy"))
    out = invoke("ac", "-c", "-lt", tmp_path / "n", "-rt", tmp_path / "g",
                 data_dir=tmp_path / "ws")
    assert out.exit_code == 2, out.output
    assert "1 unreadable (file missing) (Mint.mul.0.forward)" in out.output
    assert "sound" not in out.output


def test_a_dump_with_no_whole_step_and_a_directory_that_is_none(tmp_path):
    where = write_dump(tmp_path / "n", _model())
    os.remove(os.path.join(where, "dump.json"))          # msprobe writes it as the step ends
    out = invoke("import", tmp_path / "n", data_dir=tmp_path / "ws")
    assert out.exit_code == 2
    assert "holds no whole step: no dump.json in any of its rank directories" in out.output
    (tmp_path / "plain").mkdir()
    out = invoke("import", tmp_path / "plain", data_dir=tmp_path / "ws")
    assert out.exit_code == 2 and "is not an msprobe dump" in out.output


def test_the_source_line_and_module_come_from_stack_and_construct(tmp_path):
    where = write_dump(tmp_path / "n", _model())
    json.dump({"0": [["Mint.mul.0.forward"],
                     ["File /usr/lib/python3/site-packages/mindspore/ops.py, line 9, in mul, \n x",
                      "File /home/u/train.py, line 42, in forward, \n h = h * s"]]},
              open(os.path.join(where, "stack.json"), "w"))
    json.dump({"Mint.mul.0.forward": "Module.blocks.0.mlp.MLP.forward.0"},
              open(os.path.join(where, "construct.json"), "w"))
    calls = msprobe.read_calls(where)
    assert calls["Mint.mul.0.forward"] == {"module": "blocks.0.mlp",
                                           "source": "/home/u/train.py:42 in forward"}


# -- real msprobe dumps -------------------------------------------------------------------------
def _msprobe():
    pytest.importorskip("torch", reason="msprobe's PyTorch debugger needs torch")
    pytest.importorskip("msprobe", reason="mindstudio-probe makes the real dumps "
                                          "(pip install 'precision_tool[msprobe]')")


def _dump(out, *args, npu=False, env=None):
    """The example script dumped by msprobe: as it is (a CPU baseline), or under torch-run
    on the simulated NPU (npu: the torch-run options)."""
    run = [sys.executable, EXAMPLE, str(out), *args]
    if npu is not False:
        run = [sys.executable, "-m", "precision_tool", "--data-dir", f"{out}.ws", "torch-run",
               "--target", "npu", "--dump-step", "1000", *npu, "--", EXAMPLE, str(out), *args]
    done = subprocess.run(run, capture_output=True, text=True, cwd=os.path.dirname(str(out)),
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return str(out)


@pytest.fixture(scope="module")
def real_dumps(tmp_path_factory):
    _msprobe()
    root = tmp_path_factory.mktemp("msprobe")
    made = {}
    for task in ("tensor", "statistics", "md5"):
        made[f"golden-{task}"] = _dump(root / f"golden-{task}", "--task", task)
        made[f"npu-{task}"] = _dump(root / f"npu-{task}", "--task", task, npu=[])
    made["golden-L0"] = _dump(root / "golden-L0", "--level", "L0")
    made["npu-L0"] = _dump(root / "npu-L0", "--level", "L0", npu=[])
    plant = ["--plant", "unnormalised-inputs"]
    made["golden-planted"] = _dump(root / "golden-planted", *plant)
    made["npu-planted"] = _dump(root / "npu-planted", *plant,
                                npu=["--overflow-mode", "inf_nan"])
    return root, made


@pytest.mark.parametrize("task", ["tensor", "statistics", "md5"])
def test_real_clean_dumps_of_the_simulated_npu_are_sound(real_dumps, tmp_path, task):
    root, made = real_dumps
    out = invoke("ac", "-c", "-lt", made[f"npu-{task}"], "-rt", made[f"golden-{task}"],
                 data_dir=tmp_path / "ws")
    assert out.exit_code == 0, out.output
    assert "Precision looks sound" in out.output
    steps = json.loads(invoke("--json", "import", made[f"npu-{task}"],
                              data_dir=tmp_path / "ws").stdout)["runs"][0]
    assert steps["steps"] == [0, 1, 2] and steps["task"] == ("statistics" if task == "md5"
                                                             else task)


def test_real_module_level_dumps_tell_cancellation_from_divergence(real_dumps, tmp_path):
    """At L0 a module's parameter gradients have no call that made them; read as sums and
    contractions of what the module's backward received (and its forward read), the
    key bias's gradient (zero in exact arithmetic) is cancellation noise, not an origin."""
    root, made = real_dumps
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "ac", "-c",
                                   "-lt", made["npu-L0"], "-rt", made["golden-L0"]])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert "Module.k.Linear.parameters_grad.0.bias" in result["cancellations"]
    ws = Workspace(str(tmp_path / "ws"))
    table = ws.index_table(ws.run("npu"), 0)
    rows = [r for r in table.records() if r["op_name"] == "Module.k.Linear.parameters_grad.0.weight"]
    assert [r["io"] for r in rows] == ["input", "input", "output"]
    assert rows[-1]["sum_kind"] == "contraction"


def _msprobe_first_error(target, golden, out):
    """msprobe's own compare of step 0: the first row (its rows follow execution order) it
    does not pass, as an API call name."""
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "msprobe"), "compare",
                           "-tp", os.path.join(target, "step0"),
                           "-gp", os.path.join(golden, "step0"), "-o", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    import pandas as pd
    table = pd.read_csv(glob.glob(os.path.join(out, "compare_result_*.csv"))[0])
    worst = table[table["Result"] != "pass"]["NPU Name"].iloc[0]
    return re.sub(r"\.(input|output)\.\d+$", "", worst)


def test_real_planted_dumps_name_the_api_msprobes_compare_ranks_worst(real_dumps, tmp_path):
    root, made = real_dumps
    worst = _msprobe_first_error(made["npu-planted"], made["golden-planted"], tmp_path / "cmp")
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "ac", "-c",
                                   "-lt", made["npu-planted"], "-rt", made["golden-planted"]])
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    origin = result["origin"]
    assert origin["op_name"] == worst == "Tensor.__matmul__.0.forward"
    assert origin["call_site"].startswith(EXAMPLE + ":")
    assert origin["imported"]
    assert "in the script (its inputs .float(), or outside autocast)" in result["advice"][0]
    assert "torch-run --keep-fp32 Tensor.__matmul__" in result["advice"][0]
    # the source line in ni, from stack.json
    ni = invoke("ni", "Tensor.__matmul__.0.forward", data_dir=tmp_path / "ws")
    assert ni.exit_code == 0 and f"source: {EXAMPLE}:" in ni.output


def test_a_real_bf16_scripts_dump_pairs_call_for_call_with_its_fp32_baseline(tmp_path):
    """A device script in bfloat16 (the model and its inputs .bfloat16(), the logits
    .float()) dumped by msprobe, against the same script in float32: msprobe dumps no cast
    call (Tensor.float, Tensor.bfloat16), so the calls pair name for name with nothing
    left over, every tensor of every step is compared, and three healthy steps are sound
    (the key bias's gradient, zero in exact arithmetic, diverges with no effect)."""
    _msprobe()
    bf16 = _dump(tmp_path / "bf16", "--bf16")
    fp32 = _dump(tmp_path / "fp32")
    with open(glob.glob(os.path.join(bf16, "step0", "*", "dump.json"))[0]) as f:
        calls = json.load(f)["data"]
    assert not [c for c in calls if c.split(".")[1] in ("float", "bfloat16", "to")]
    out = invoke("ac", "-c", "-lt", bf16, "-rt", fp32, data_dir=tmp_path / "ws")
    assert out.exit_code == 0, out.output
    assert "Precision looks sound" in out.output
    compared = re.findall(r"(\d+) of (\d+) tensors compared", out.output)
    assert len(compared) == 3 and all(a == b and int(a) > 200 for a, b in compared), compared
    table = Workspace(str(tmp_path / "ws")).index_table(
        Workspace(str(tmp_path / "ws")).run("npu"), 0)
    assert {r["dtype"] for r in table.records() if r["op_name"] == "Functional.linear.0.forward"
            and r["io"] == "output"} == {"bfloat16"}


def test_real_tensor_files_read_as_torch_reads_them(real_dumps):
    torch = _torch()
    root, made = real_dumps
    files = sorted(glob.glob(os.path.join(made["npu-tensor"], "step0", "*",
                                          "dump_tensor_data", "*.pt")))
    assert len(files) > 50
    for path in files[::7]:
        want = torch.load(path, weights_only=True)
        got = read_tensor_file(path)
        np.testing.assert_array_equal(got, want.numpy())


def test_a_pickle_in_a_real_dump_that_wants_more_is_refused(real_dumps, tmp_path):
    root, made = real_dumps
    copy = tmp_path / "n"
    shutil.copytree(made["npu-tensor"], copy)
    target = sorted(glob.glob(str(copy / "step0" / "*" / "dump_tensor_data" /
                                  "Tensor.__matmul__.0.forward.output.0.pt")))[0]
    marker = tmp_path / "ran"
    _zip_with_pickle(target, pickle.dumps(_Runs(f"touch {marker}"), protocol=2))
    out = invoke("vc", "-lt", copy, "-rt", made["golden-tensor"], data_dir=tmp_path / "ws")
    assert out.exit_code == 2, out.output
    assert "1 unreadable (pickle refused: it asks for more than a tensor) " \
        "(Tensor.__matmul__.0.forward)" in out.output
    assert not marker.exists()


# -- export -------------------------------------------------------------------------------------
def _graph_dump(root):
    import precision_tool as pt
    from precision_tool import hooks
    from precision_tool.data import digits
    d = digits()
    m = pt.models.cnn()
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="allow_mix_precision"), action="dump",
        data_dir=str(root)))
    cpu = hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=str(root))
    feed = {m.x: d.x_train[:8], m.y: d.y_train[:8]}
    for sess in (npu, cpu):
        sess.run([m.loss, m.train_op], feed)
        sess.close()
    return Workspace(str(root))


def test_export_writes_every_tensor_as_torch_reads_it(tmp_path):
    torch = _torch()
    ws = _graph_dump(tmp_path / "ws")
    run = ws.run("npu")
    out = invoke("--json", "export", "-r", "npu/debug_0", "-o", tmp_path / "out",
                 data_dir=tmp_path / "ws")
    assert out.exit_code == 0, out.output
    done = json.loads(out.stdout)
    assert done["steps"] == [0] and done["tensors"] > 50
    where = tmp_path / "out" / "step0" / "rank0"
    dump = json.load(open(where / "dump.json"))
    assert dump["task"] == "tensor" and dump["framework"] == "pytorch"
    table = ws.index_table(run, 0)
    by_row = {(r["op_name"], r["io"]): r for r in table.records()}
    conv = "Conv2D.conv1_Conv2D.0.forward"
    assert conv in dump["data"]                 # conv1/Conv2D, its '/' mangled
    entry = dump["data"][conv]["output"][0]
    saved = torch.load(where / "dump_tensor_data" / entry["data_name"], weights_only=True)
    # in NCHW, as the model holds it (the dump is NC1HWC0)
    row = by_row[("conv1/Conv2D", "output")]
    assert row["format"] == "NC1HWC0" and saved.dim() == 4
    assert list(saved.shape) == [int(d) if d.isdigit() else 8
                                 for d in row["original_shape"].split()]
    from precision_tool import numerics
    want = numerics.five_hd_to_nchw(ws.load(run, 0, row["file"]), list(saved.shape))
    np.testing.assert_array_equal(saved.numpy(), want)
    assert entry["Max"] == float(want.astype(np.float64).max())
    # read back as a run of its own: the same number of tensors, the same values
    back = ws.imported(str(tmp_path / "out"), "gpu")[0]
    assert len(ws.index_table(back, 0)) == done["tensors"]
    # never over an existing directory, never half-written
    again = invoke("export", "-r", "npu/debug_0", "-o", tmp_path / "out", data_dir=tmp_path / "ws")
    assert again.exit_code == 2 and "exists" in again.output
    assert not os.path.exists(str(tmp_path / "out") + ".partial")


def test_msprobe_compare_of_an_export_agrees_with_vc(tmp_path):
    _msprobe()
    ws = _graph_dump(tmp_path / "ws")
    for target in ("npu", "cpu"):
        out = invoke("export", "-r", f"{target}/debug_0", "-o", tmp_path / target,
                     data_dir=tmp_path / "ws")
        assert out.exit_code == 0, out.output
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "msprobe"), "compare",
                           "-tp", str(tmp_path / "npu" / "step0"),
                           "-gp", str(tmp_path / "cpu" / "step0"), "-o", str(tmp_path / "cmp")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    import pandas as pd
    theirs = pd.read_csv(glob.glob(str(tmp_path / "cmp" / "compare_result_*.csv"))[0])
    ours = compare_step(ws, ws.run("npu"), ws.run("cpu"), 0)
    from precision_tool.dump.export import call_name
    cosine = {}
    for r in ours.records():
        if r["GroundTruth"] and r["NPUDump"] == r["GroundTruth"] and r["CosineSimilarity"] == \
                r["CosineSimilarity"]:
            io_, k = r["TensorIndex"].rsplit(":", 2)[1:]
            cosine[f"{call_name(r['OpType'], r['NPUDump'])}.{io_}.{k}"] = r["CosineSimilarity"]
    theirs["cos"] = pd.to_numeric(theirs["Cosine"], errors="coerce")
    both = [(cosine[n], c) for n, c in zip(theirs["NPU Name"], theirs["cos"])
            if n in cosine and c == c]
    assert len(both) > 30
    worst = max(abs(a - b) for a, b in both)
    assert worst < 1e-5, worst


# -- many ranks ---------------------------------------------------------------------------------
def _ddp_dump(out, *args):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                           os.path.join(ROOT, "examples", "msprobe_ddp.py"), str(out), *args],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def ddp_dumps(tmp_path_factory):
    _msprobe()
    root = tmp_path_factory.mktemp("ddp")
    return _ddp_dump(root / "clean"), _ddp_dump(root / "planted", "--plant", "nan-on-rank1")


@pytest.fixture(scope="module")
def ddp_unsynced(tmp_path_factory):
    _msprobe()
    return _ddp_dump(tmp_path_factory.mktemp("ddp-lr") / "lr", "--plant", "lr-on-rank1")


def test_replicas_that_drift_apart_are_named(ddp_unsynced, tmp_path):
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "ac", "-lt",
                                   str(ddp_unsynced)])
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    ranks = result["ranks"]
    assert ranks["origin"] == [] and ranks["step"] == -1
    first = ranks["disagree"][0]
    # step 0's parameters agree; rank 1's own learning rate shows in step 1's
    assert (first["step"], first["rank"], first["what"]) == (1, "rank1", "parameter")
    assert first["tensor"] == "Functional.linear.0.forward:input:1"
    assert first["detail"].startswith("norm ")
    assert "The ranks disagree where replicas must agree: in step 1" in result["advice"][0]


def test_a_nan_spread_by_all_reduce_is_traced_to_the_rank_that_made_it(ddp_dumps, tmp_path):
    clean, planted = ddp_dumps
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "ac", "-lt",
                                   str(planted)])
    assert out.exit_code == 1, out.output
    ranks = json.loads(out.stdout)["ranks"]
    assert ranks["step"] == 1 and ranks["ranks"] == 2
    [origin] = ranks["origin"]
    assert (origin["rank"], origin["op_name"]) == ("rank1", "Tensor.log.0.forward")
    assert origin["source"].startswith(os.path.join(ROOT, "examples", "ddp_train.py") + ":")
    [got] = ranks["received"]
    assert got["rank"] == "rank0" and got["op_name"].startswith("Distributed.all_reduce.")
    # every rank holds the nan by then: rank 0's own first nan/inf is the collective's output
    assert got["epoch"] == 0
    advice = json.loads(out.stdout)["advice"][0]
    assert advice.startswith("nan/inf first appears in step 1 on rank1 (npu/debug_1) at "
                             "Tensor.log.0.forward")
    assert advice.endswith("Look at that rank: ac -c -lt npu/debug_1.")


def test_clean_ranks_say_nothing_and_ranks_with_different_steps_are_incomplete(ddp_dumps,
                                                                                tmp_path):
    clean, planted = ddp_dumps
    out = invoke("ac", "-lt", clean, data_dir=tmp_path / "ws")
    assert out.exit_code == 0, out.output
    copy = tmp_path / "copy"
    shutil.copytree(clean, copy)
    shutil.rmtree(copy / "step2" / "rank1")           # rank 1 never dumped step 2
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws2"), "--json", "ac", "-lt",
                                   str(copy)])
    assert out.exit_code == 2, out.output
    result = json.loads(out.stdout)
    assert result["ranks"]["partial_steps"] == [2]
    assert result["verdict"] == "incomplete"


def test_calls_one_dump_lacks_are_listed_and_the_rest_paired_in_place(tmp_path):
    """An extra call shifts every later index of its API: pairing by name would compare the
    wrong tensors. Aligned, each call meets its counterpart, and the extra one is listed."""
    calls = _model()
    x = calls[0][1][0]
    extra = ("Mint.mul.0.forward", [x], [x * 2])
    shifted = [calls[0], extra] + [(name.replace("Mint.mul.0", "Mint.mul.1"), i, o)
                                   for name, i, o in calls[1:]]
    write_dump(tmp_path / "n", shifted)
    write_dump(tmp_path / "g", calls)
    ws = Workspace(str(tmp_path / "ws"))
    npu, gold = ws.imported(str(tmp_path / "n"), "npu")[0], ws.imported(str(tmp_path / "g"),
                                                                        "cpu")[0]
    table = compare_step(ws, npu, gold, 0)
    by = {r["TensorIndex"]: r for r in table.records()}
    # the extra call: listed, not compared with the reference's Mint.mul.0
    assert by["Mint.mul.0.forward:output:0"]["Verdict"] == "error"
    assert by["Mint.mul.0.forward:output:0"]["CompareFailReason"].startswith(
        "no counterpart call")
    # the shifted one meets the reference's Mint.mul.0, and matches it
    assert by["Mint.mul.1.forward:output:0"]["GroundTruth"] == "Mint.mul.0.forward"
    assert by["Mint.mul.1.forward:output:0"]["Verdict"] == "pass"
    assert by["Mint.mul.1.forward:input:0"]["Verdict"] == "pass"
    assert {r["Verdict"] for r in table.records() if not r["NPUDump"].startswith(
        "Mint.mul.0")} == {"pass"}
    out = invoke("vc", "-lt", "npu/debug_0", "-rt", "cpu/debug_0", data_dir=tmp_path / "ws")
    assert out.exit_code == 2
    assert "2 not: 2 of calls the reference did not make (Mint.mul.0.forward)\n" in out.output
    # and the other way round: a call only the reference made
    table = compare_step(ws, gold, npu, 0)
    missing = [r for r in table.records() if r["GroundTruth"] == "Mint.mul.0.forward"
               and r["NPUDump"] == ""]
    assert missing and missing[0]["Verdict"] == "error"


def test_clean_never_touches_an_imported_dump(tmp_path):
    write_dump(tmp_path / "n", _model(), step=0)
    partial = write_dump(tmp_path / "n", _model(), step=1)
    os.remove(os.path.join(partial, "dump.json"))          # step 1 cut off
    old = os.path.getmtime(partial) - 3600          # long quiet: a partial clean may delete
    for d, _, files in os.walk(partial):
        for f in [*files, ""]:
            os.utime(os.path.join(d, f) if f else d, (old, old))
    ws = tmp_path / "ws"
    assert invoke("import", tmp_path / "n", data_dir=ws).exit_code == 0
    listed = json.loads(invoke("--json", "ls", data_dir=ws).stdout)["runs"][0]
    assert listed["partial_steps"] == [1] and listed["bytes"] > 1000   # the dump's bytes
    out = invoke("clean", data_dir=ws)
    assert out.exit_code == 0, out.output
    assert os.path.isdir(partial) and os.listdir(os.path.join(partial, "dump_tensor_data"))


def test_a_rank_is_compared_with_the_same_rank_of_the_reference(tmp_path):
    for rank, scale in (("rank0", 1.0), ("rank1", 2.0)):
        write_dump(tmp_path / "n", _model(scale), rank=rank)
        write_dump(tmp_path / "g", _model(scale), rank=rank)
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "vc", "-lt",
                                   str(tmp_path / "n" / "step0" / "rank1"), "-rt",
                                   str(tmp_path / "g")])
    assert out.exit_code == 0, out.output          # rank 1 against rank 1: all pass
    result = json.loads(out.stdout)
    ws = Workspace(str(tmp_path / "ws"))
    assert ws.resolve_run(result["npu_run"], "npu").info["rank"] == "rank1"
    assert ws.resolve_run(result["golden_run"], "cpu").info["rank"] == "rank1"


def _ranks_model(planted_rank=None):
    """Two ranks of one step: matmul, mul (times -1 on planted_rank), an all_reduce of the
    products (every rank gets the sum), relu, sum."""
    made = {}
    ms = []
    for rank in (0, 1):
        rng = np.random.default_rng(rank)
        x = rng.standard_normal((4, 8)).astype(np.float32)
        w = np.random.default_rng(9).standard_normal((8, 8)).astype(np.float32)
        h = x @ w
        m = h * (-1.0 if rank == planted_rank else 1.0)
        made[rank] = (x, w, h, m)
        ms.append(m)
    total = ms[0] + ms[1]
    out = {}
    for rank, (x, w, h, m) in made.items():
        r = np.maximum(total, 0)
        out[rank] = [("Mint.matmul.0.forward", [x, w], [h]), ("Mint.mul.0.forward", [h], [m]),
                     ("Distributed.all_reduce.0.forward", [m], [total]),
                     ("Functional.relu.0.forward", [total], [r]),
                     ("Tensor.sum.0.forward", [r], [np.float32(r.sum()).reshape(())])]
    return out


def test_a_divergence_spread_across_ranks_is_placed_the_same_on_workers(tmp_path):
    for name, planted in (("n", 1), ("g", None)):
        for rank, calls in _ranks_model(planted).items():
            write_dump(tmp_path / name, calls, rank=f"rank{rank}")
    results = []
    for workers in ("1", "2"):
        out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / f"ws{workers}"), "--json",
                                       "ac", "-c", "-w", workers, "-lt", str(tmp_path / "n"),
                                       "-rt", str(tmp_path / "g")])
        assert out.exit_code == 1, out.output
        results.append(json.loads(out.stdout)["ranks_divergence"])
    spread = results[0]
    assert [(f["rank"], f["op_name"]) for f in spread["first"]] == [("rank1", "Mint.mul.0.forward")]
    assert [(f["rank"], f["op_name"], f["received"]) for f in spread["ranks"]
            if f["rank"] == "rank0"] == [("rank0", "Distributed.all_reduce.0.forward", True)]
    assert results[1] == spread


def test_a_cut_off_step_of_an_imported_dump_is_named_and_clean_not_offered(tmp_path):
    write_dump(tmp_path / "n", _model(), step=0)
    cut = write_dump(tmp_path / "n", _model(), step=1)
    os.remove(os.path.join(cut, "dump.json"))
    write_dump(tmp_path / "g", _model(), step=0)
    out = invoke("vc", "-lt", tmp_path / "n", "-rt", tmp_path / "g", data_dir=tmp_path / "ws")
    assert out.exit_code == 0, out.output
    assert "step(s) 1 are partial (their msprobe dump has no dump.json" in out.output
    assert "clean deletes them" not in out.output
