"""The format seam (dump.formats): each on-disk format read directly, without a workspace —
the .npy tensor file (formats.npy), our index (formats.ours) and Ascend's named files
(formats.ascend) — and the registry that picks the format of a step directory."""
import os

import ml_dtypes
import numpy as np
import pytest

from precision_tool.dump import formats
from precision_tool.dump import layout
from precision_tool.dump.formats import ascend, npy, ours
from precision_tool.errors import WorkspaceError


# -- formats.npy ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int32", "int64",
                                   "uint8", "bool", "complex64", "bfloat16"])
def test_npy_reads_what_numpy_writes(tmp_path, dtype):
    rng = np.random.default_rng(0)
    want = rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    np.save(tmp_path / "a.npy", want)
    got = npy.read_tensor_file(str(tmp_path / "a.npy"))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert npy.npy_header(str(tmp_path / "a.npy"))[0] == (3, 5)


def test_npy_maps_a_large_file_and_reads_a_small_one(tmp_path):
    np.save(tmp_path / "big.npy", np.arange(1000, dtype=np.float32))
    mapped = npy.read_tensor_file(str(tmp_path / "big.npy"), mmap_over=100)
    assert isinstance(mapped, np.memmap) and not mapped.flags.writeable
    assert np.array_equal(mapped, np.arange(1000, dtype=np.float32))
    assert not isinstance(npy.read_tensor_file(str(tmp_path / "big.npy")), np.memmap)


def test_npy_refuses_pickles_and_cut_files_in_one_line(tmp_path):
    np.save(tmp_path / "p.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(WorkspaceError, match="Python objects.*allow_pickle=False"):
        npy.read_tensor_file(str(tmp_path / "p.npy"))
    np.save(tmp_path / "c.npy", np.arange(100, dtype=np.float32))
    data = (tmp_path / "c.npy").read_bytes()
    (tmp_path / "c.npy").write_bytes(data[:-7])
    with pytest.raises(WorkspaceError, match="cut off.*needs 400 data bytes, the file holds 393"):
        npy.read_tensor_file(str(tmp_path / "c.npy"))
    with pytest.raises(WorkspaceError, match="is missing"):
        npy.read_tensor_file(str(tmp_path / "none.npy"))


def test_confined_refuses_what_resolves_outside_its_roots(tmp_path):
    inside, results, outside = (tmp_path / d for d in ("ws", "res", "elsewhere"))
    for d in (inside, results, outside):
        d.mkdir()
        np.save(d / "t.npy", np.zeros(2, np.float32))
    os.symlink(outside / "t.npy", inside / "link.npy")
    opener = npy.Confined(str(inside), lambda: str(results))
    assert npy.read_tensor_file(str(inside / "t.npy"), opener).shape == (2,)
    assert npy.read_tensor_file(str(results / "t.npy"), opener).shape == (2,)   # the late root
    for bad in (outside / "t.npy", inside / "link.npy", inside / ".." / "elsewhere" / "t.npy"):
        with pytest.raises(WorkspaceError, match="outside the workspace"):
            npy.read_tensor_file(str(bad), opener)


# -- formats.ours and formats.ascend, picked by the registry ---------------------------------
def test_a_step_with_an_index_is_ours_and_one_without_is_read_by_its_names(tmp_path):
    step = tmp_path / "step"
    step.mkdir()
    np.save(step / "MatMul.fc1_MatMul.3.0.1700000000000001.output.0.npy", np.ones((2, 4), np.float16))
    np.save(step / "Relu.relu.4.1700000000000002.input.0.npy", np.ones((2, 4), np.float16))
    (step / "notes.txt").write_text("not a tensor")
    assert not ours.claims(str(step)) and ascend.claims(str(step))
    table = formats.read_step_index(str(step), layout.DEVICE)
    assert table["op_name"].tolist() == ["fc1_MatMul", "relu"]
    assert table["tensor"].tolist() == ["fc1_MatMul:0", ""]       # an input says no tensor
    assert table["stream_id"][1] != table["stream_id"][1]          # no stream id: nan
    assert table["dtype"].tolist() == ["float16", "float16"] and table["shape"][0] == "2 4"
    assert set(formats.INDEX_COLUMNS) <= set(table.columns)
    golden = tmp_path / "golden"
    golden.mkdir()
    np.save(golden / "fc1_MatMul.0.1700000000000001.npy", np.ones(3, np.float32))
    assert formats.read_step_index(str(golden), layout.REFERENCE)["tensor"].tolist() == ["fc1_MatMul:0"]
    # an index.csv makes the directory ours, read by its rows, cut ones refused by number
    header = ",".join(formats.INDEX_COLUMNS)
    (step / "index.csv").write_text(f"{header}\nRelu,relu,output,0,relu:0,float16,2 4,r.npy\n"
                                    f"Relu,relu,outp")
    assert ours.claims(str(step))
    with pytest.raises(WorkspaceError, match="row 3 is incomplete"):
        formats.read_step_index(str(step), layout.DEVICE)
    (step / "index.csv").write_text(f"{header}\nRelu,relu,output,0,relu:0,float16,2 4,r.npy\n")
    assert formats.read_step_index(str(step), layout.DEVICE)["file"].tolist() == ["r.npy"]


def test_our_run_files_are_read_or_refused_in_one_line(tmp_path):
    class R:                 # what the readers ask of a run
        path, ours, target, label = str(tmp_path), True, "npu", "npu/debug_0"
        kind = layout.DEVICE
        info = {"graph_sha1": "0" * 40, "fusion_passes": []}    # what our NPU dump records
    with pytest.raises(WorkspaceError, match="has no compiled graph"):
        ours.read_compiled_graph(R)
    with pytest.raises(WorkspaceError, match="has no fusion result"):
        ours.read_fusion_result(R)

    class Compiled(R):       # a device run of a front-end that compiles no graph
        info = {}
    assert ours.read_compiled_graph(Compiled) is None and ours.read_fusion_result(Compiled) is None
    (tmp_path / "fusion_result.json").write_text('{"g": {"graph_fusion": {"P": '
                                                 '{"effect_times": 1, "fused_nodes": ["a"]}}}}')
    assert ours.read_fusion_result(R) == {"P": ["a"]}
    (tmp_path / "fusion_result.json").write_text('{"g": {"graph_fusion": {"P": 3}}}')
    with pytest.raises(WorkspaceError, match="fusion result .* is broken"):
        ours.read_fusion_result(R)
    (tmp_path / "step_history.csv").write_text("step,status,loss_scale,next_loss_scale,finite,loss\n"
                                               "0,0,,,,2.5\n1,0,,,,2.4\n2,0,,,,2.")
    assert ours.read_step_history(R)["step"].tolist() == [0, 1]    # the torn line is dropped
    assert ours.read_run_json(str(tmp_path / "missing.json")) == {}


def test_a_runs_configuration_is_typed_and_a_broken_one_named(tmp_path):
    """Run.config: run.json's NPU fields as a SessionConfig (what analysis reads the mode
    from), the defaults for a foreign run, and one line naming the run for a mode the policy
    does not know."""
    import json
    from precision_tool.dump import Workspace
    for target, info in (("npu", {"writer": "precision_tool", "precision_mode": "force_fp16",
                                  "amp_level": None, "overflow_mode": "inf_nan"}),
                         ("cpu", {})):
        run_dir = tmp_path / target / "debug_0"
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps(info))
    ws = Workspace(str(tmp_path))
    npu = ws.run("npu")
    assert npu.config.effective_mode == "force_fp16" and npu.config.overflow_mode == "inf_nan"
    assert ws.run("cpu").config.golden_dtype == "float32"
    (tmp_path / "npu" / "debug_0" / "run.json").write_text(json.dumps({"precision_mode": "fp8"}))
    with pytest.raises(WorkspaceError, match=r"npu/debug_0: run.json holds a configuration "
                                             r"that cannot be used: precision_mode must be"):
        Workspace(str(tmp_path)).run("npu").config
