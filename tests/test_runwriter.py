"""The writing seam: a run written without a Session (runwriter.RunWriter) is read and
compared as the dump observer's runs are; targets are data (a name and a kind)."""
import json
import os

import numpy as np
import pytest

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis.comparing.compare import compare_step
from precision_tool.dump import Workspace, layout
from precision_tool.dump.runwriter import OpSpec, Record, RunWriter, TensorSpec
from precision_tool.errors import PrecisionToolError

GPU = layout.Target("gpu", layout.REFERENCE)


def _dumped(root):
    """One training step of the MLP dumped on both targets."""
    m = pt.models.mlp()
    d = pt.data.digits()
    cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="allow_mix_precision"),
                                    action="dump", data_dir=root)
    feed = {m.x: d.x_train[:32], m.y: d.y_train[:32]}
    with pt.Session(m.graph, target="npu", config=cfg) as npu, \
            hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=root) as cpu:
        npu.run([m.loss, m.train_op], feed)
        cpu.run([m.loss, m.train_op], feed)
    return m


def _records_from(ws, run, step):
    """A front-end's view of a step: each op's type, name, inputs and output values, read
    back from a dumped run (what another executor would hand the writer)."""
    table = ws.index(run, step)
    ops = {}
    for r in table.itertuples():
        op = ops.setdefault(r.op_name, {"type": r.op_type, "outs": {}, "ins": {}})
        value = ws.load(run, step, r.file)
        (op["outs"] if r.io == "output" else op["ins"])[int(r.index)] = (r.tensor, value)
    records = []
    for name, op in ops.items():
        outs = [op["outs"][k][1] for k in sorted(op["outs"])]
        ins = [op["ins"][k] for k in sorted(op["ins"])]
        spec = OpSpec(op["type"], name, tuple(t for t, _ in ins),
                      tuple(TensorSpec(v.dtype.name) for _, v in ins),
                      tuple(TensorSpec(v.dtype.name) for v in outs))
        records.append(Record(spec, [v for _, v in ins], outs, None, 1))
    return records


def test_a_run_written_without_a_session_compares_as_the_golden_does(tmp_path):
    """Another executor's values (here the golden's, read back) written through the writer
    under a target of its own: listed, named by label, read with the same index and compared
    against the NPU to the same numbers as the golden run it copies."""
    root = str(tmp_path)
    _dumped(root)
    ws = Workspace(root)
    golden = ws.run("cpu")
    writer = RunWriter(root, GPU, {"graph": "mlp", "values_from": "test"})
    writer.write_step(0, _records_from(ws, golden, 0))
    writer.finish()
    ws = Workspace(root)
    assert ws.targets == ["npu", "cpu", "gpu"]
    gpu = ws.resolve_run("gpu/debug_0", "cpu")
    assert (gpu.kind, gpu.complete_steps, gpu.info["dumped_steps"]) == (layout.REFERENCE, [0], [0])
    assert ws.resolve_run("debug_0", "gpu") is gpu
    mine, theirs = ws.index(gpu, 0), ws.index(golden, 0)
    keys = ["op_name", "io", "index", "tensor", "dtype", "shape"] + list(pt.kernels.STAT_FIELDS)
    assert len(mine) == len(theirs)
    for key in keys:
        assert sorted(map(str, mine[key])) == sorted(map(str, theirs[key])), key
    npu = ws.run("npu")
    a = compare_step(ws, npu, golden, 0).to_frame().sort_values("TensorIndex")
    b = compare_step(ws, npu, gpu, 0).to_frame().sort_values("TensorIndex")
    assert len(a) == len(b) > 20 and (a.GroundTruth != "*").all()
    for column in ("TensorIndex", "GroundTruth", "CosineSimilarity", "MaxAbsoluteError",
                   "Verdict", "Reason"):
        assert a[column].astype(str).tolist() == b[column].astype(str).tolist(), column


def test_a_device_run_of_another_front_end_is_read_in_the_device_layout(tmp_path):
    """A device run written by ops described as OpSpecs (no graph, no Session): Ascend's
    deep step layout and NPU index, no compiled graph asked for, values as written."""
    class Task:
        task_id, stream_id = 7, 0
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = (x * 2).astype(np.float16)
    spec = OpSpec("Mul", "scale/mul", ("x:0",), (TensorSpec("float32"),), (TensorSpec("float16"),))
    writer = RunWriter(str(tmp_path), layout.Target("sim", layout.DEVICE), {"graph": "toy"})
    path = writer.write_step(3, [Record(spec, [x], [y], Task, 123)])
    writer.finish()
    assert os.path.relpath(path, writer.run_dir).split(os.sep)[:1] == ["dump"]
    assert len(os.path.relpath(path, writer.run_dir).split(os.sep)) == 6
    ws = Workspace(str(tmp_path))
    run = ws.run("sim")
    assert run.kind == layout.DEVICE and run.complete_steps == [3]
    assert ws.compiled_graph(run) is None and ws.fusion_result(run) is None
    table = ws.index(run, 3)
    assert table.columns.tolist()[:4] == ["op_type", "op_name", "task_id", "stream_id"]
    out = table[table.io == "output"].iloc[0]
    assert (out.op_name, out.task_id, out["dtype"], out.file) == (
        "scale/mul", 7, "float16", layout.npu_file_name("Mul", "scale/mul", 7, 0, 123, "output", 0))
    got = ws.load(run, 3, out.file)
    assert got.dtype == np.float16 and np.array_equal(got, y)
    assert out["max"] == 10.0 and out["min"] == 0.0
    assert np.array_equal(ws.load(run, 3, table[table.io == "input"].iloc[0].file), x)


def test_a_step_that_cannot_be_written_leaves_nothing_that_looks_begun(tmp_path):
    writer = RunWriter(str(tmp_path), GPU, {})
    os.makedirs(writer.steps_dir(), exist_ok=True)
    with open(writer.steps_dir() + "0", "w") as f:      # a file where the step must go
        f.write("in the way")
    spec = OpSpec("Relu", "r", (), (), (TensorSpec("float32"),))
    with pytest.raises(PrecisionToolError):
        writer.write_step(0, [Record(spec, [], [np.ones(3, np.float32)], None, 1)])
    assert sorted(os.listdir(writer.steps_dir())) == ["0"]          # no partial left behind
    writer.finish()
    info = json.loads(open(os.path.join(writer.run_dir, "run.json")).read())
    assert info["dumped_steps"] == [] and info["kind"] == layout.REFERENCE


@pytest.mark.parametrize("name, kind", [("../x", layout.REFERENCE), ("GPU", layout.REFERENCE),
                                        ("config", layout.REFERENCE), ("", layout.DEVICE),
                                        ("gpu", "golden"), ("a" * 33, layout.DEVICE)])
def test_a_target_is_a_safe_directory_name_and_a_known_kind(name, kind):
    with pytest.raises(layout.DumpConfigError):
        layout.Target(name, kind)


def test_runs_written_before_kinds_were_recorded_take_them_from_their_directory():
    assert layout.target_of("npu", {}) == layout.NPU
    assert layout.target_of("cpu", {"kind": "bogus"}) == layout.GOLDEN
    assert layout.target_of("gpu", {"kind": layout.DEVICE}).kind == layout.DEVICE


def test_directories_that_are_not_runs_are_not_targets(tmp_path):
    """config/, temp/ and a directory without a run of ours are never listed as targets."""
    root = str(tmp_path)
    _dumped(root)
    for d in ("config/debug_0", "notes/debug_0", "temp/debug_0"):
        os.makedirs(os.path.join(root, d))
    with open(os.path.join(root, "config", "debug_0", "run.json"), "w") as f:
        f.write("{}")
    assert Workspace(root).targets == ["npu", "cpu"]


def test_an_op_name_reused_with_other_inputs_is_indexed_with_its_own(tmp_path):
    """A front-end may give one name to ops that read other tensors in other steps (a
    script's Tensor.__getitem__.1 reads an initialiser in step 0, the encoder's output in
    step 1): each step's index names what that step's op read."""
    writer = RunWriter(str(tmp_path), GPU, {"graph": "script"})
    value = np.ones(3, dtype=np.float32)

    def step(number, producer):
        made = OpSpec("Torch.producer", producer, (), (), (TensorSpec("float32"),))
        read = OpSpec("Tensor.__getitem__", "Tensor.__getitem__.1.forward", (f"{producer}:0",),
                      (TensorSpec("float32"),), (TensorSpec("float32"),))
        writer.write_step(number, [Record(made, [], [value], None, 1),
                                   Record(read, [value], [value], None, 2)])
    step(0, "Torch.normal_.3.forward")
    step(1, "Functional.layer_norm.4.forward")
    writer.finish()
    ws = Workspace(str(tmp_path))
    run = ws.run("gpu")
    for number, producer in ((0, "Torch.normal_.3.forward"), (1, "Functional.layer_norm.4.forward")):
        t = ws.index(run, number)
        row = t[(t.op_name == "Tensor.__getitem__.1.forward") & (t.io == "input")].iloc[0]
        assert row.tensor == f"{producer}:0"


@pytest.mark.parametrize("files", [True, False])
def test_a_steps_plan_is_reused_only_for_the_same_ops_shapes_and_dtypes(tmp_path, files):
    """write_step reuses the last step's plan (its index lines and file names) when the
    records are the same ops over values of the same shapes and dtypes: each step's index
    then holds its own values' statistics; a step whose shape or dtype differs is planned
    again and indexed as it is."""
    writer = RunWriter(str(tmp_path), GPU, {"graph": "script"})
    op = OpSpec("Torch.randn", "Torch.randn.0.forward", (), (), (TensorSpec("float32"),))
    values = [np.full(3, 1.0, np.float32), np.full(3, 2.0, np.float32),
              np.full((2, 4), 3.0, np.float32), np.full((2, 4), 4.0, np.float64)]
    for number, value in enumerate(values):
        writer.write_step(number, [Record(op, [], [value], None, 1)], files=files)
    writer.finish()
    ws = Workspace(str(tmp_path))
    run = ws.run("gpu")
    for number, value in enumerate(values):
        row = ws.index(run, number).iloc[0]
        assert (row["max"], row["shape"], row["dtype"]) == \
            (value.max(), " ".join(map(str, value.shape)), value.dtype.name)
        if files:
            assert np.array_equal(ws.load(run, number, row.file), value)


def test_ranks_launched_apart_are_compared_rank_with_rank(tmp_path):
    """The golden of two ranks launched apart from their NPU run (torchrun ... --target
    golden, then --target npu): each launch's ranks take run directories in the order they
    start, so rank 0 may be npu/debug_1 beside cpu/debug_0. Each NPU rank is compared with
    the golden run of its own rank, never with the newest golden (another rank's data)."""
    from click.testing import CliRunner
    from precision_tool.cli import cli
    values = {"rank0": np.linspace(-1, 1, 8, dtype=np.float32),
              "rank1": np.linspace(3, 5, 8, dtype=np.float32)}
    op = OpSpec("Functional.linear", "Functional.linear.0.forward", (), (),
                (TensorSpec("float32"),))
    for target, group, order in ((layout.GOLDEN, "golden-launch", ("rank0", "rank1")),
                                 (layout.NPU, "npu-launch", ("rank1", "rank0"))):
        for rank in order:
            writer = RunWriter(str(tmp_path), target, {
                "graph": "script", "front_end": "pytorch", "rank": rank,
                "rank_number": int(rank[-1]), "world_size": 2, "rank_group": group})
            task = type("Task", (), {"task_id": 0, "stream_id": 0, "status": 0})() \
                if target.kind == layout.DEVICE else None
            writer.write_step(0, [Record(op, [], [values[rank]], task, 1)])
            writer.finish()
    ws = Workspace(str(tmp_path))
    for npu in ws.runs("npu"):
        assert ws.reference_for(npu).info["rank"] == npu.info["rank"]
    assert ws.run("npu").info["rank"] == "rank0" and ws.run("cpu").info["rank"] == "rank1"
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["golden_run"] == "cpu/debug_0"
    # vcs summarises the result vc wrote for the same pair: current, not "run vc again"
    for args in (["vc"], ["vcs", "-c", "0.98", "-l", "10"]):
        out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), *args])
        assert out.exit_code == 0, out.output
    assert "npu/debug_1 against cpu/debug_0" in out.output


def test_a_pytorch_call_in_place_overwrites_its_tensor():
    """PyTorch's convention: Tensor.<op>_ and the in-place operators write into input 0;
    other calls, dunders and unknown names update nothing."""
    from precision_tool.ops import registry
    for name in ("Tensor.add_", "Tensor.lerp_", "Tensor.__iadd__", "Tensor.__imatmul__"):
        assert tuple(registry.updated_inputs(name)) == (0,), name
    for name in ("Tensor.add", "Tensor.__getitem__", "Tensor.__init__", "Tensor.__index__",
                 "Torch._foreach_add_", "MatMul"):
        assert tuple(registry.updated_inputs(name)) == (), name
    assert tuple(registry.updated_inputs("ApplyAdam")) == (0, 1, 2, 3, 4)
