"""analysis.ops, the library under ls and ni: a run's ops with their kernels, an op found by
name (a fused one by the name it had, a mistyped one with suggestions), and the subgraph
around an op as DOT."""
import numpy as np
import pytest

import precision_tool as pt
from precision_tool.analysis import ops
from precision_tool.dump import Workspace
from precision_tool.dump.workspace import WorkspaceError

import harness


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """A dense layer and a softmax on the NPU (MatMul + BiasAdd fused), and its golden run."""
    root = tmp_path_factory.mktemp("ops")
    g = pt.Graph("lookup", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [4, 8])
        w = pt.variable("dense/kernel", [8, 6])
        b = pt.variable("dense/bias", [6], init="zeros")
        y = pt.ops.bias_add(pt.ops.matmul(x, w, name="dense/MatMul"), b, name="dense/BiasAdd")
        probs = pt.ops.softmax(pt.ops.relu(y, name="act/Relu"), name="head/Softmax")
    harness.dump_both(str(root), g, [probs],
                      {x: np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)},
                      pt.SessionConfig(precision_mode="force_fp16"))
    ws = Workspace(str(root))
    return ws, ws.run("npu"), ws.run("cpu")


def test_list_ops_filters_by_name_type_pass_and_kernel(dumped):
    ws, npu, cpu = dumped
    rows = ops.list_ops(ws, npu)
    assert {r.name for r in rows} >= {"act/Relu", "head/Softmax"}
    fused = ops.list_ops(ws, npu, pass_name="MatMulBiasAdd")
    assert len(fused) == 1 and fused[0].kernel == "cube_float16"
    assert [r.name for r in ops.list_ops(ws, npu, op_type="Softmax")] == ["head/Softmax"]
    assert all(r.kernel.startswith("vector") for r in ops.list_ops(ws, npu, kernel="vector"))
    assert ops.list_ops(ws, npu, name="nothing such") == []
    assert fused[0].to_dict() == {"name": fused[0].name, "type": fused[0].type,
                                  "kernel": "cube_float16", "pass_name": fused[0].pass_name}
    # a golden run has no compiled graph: its ops come from its index, without kernels' dtypes
    assert "head/Softmax" in {r.name for r in ops.list_ops(ws, cpu)}


def test_find_op_by_exact_name_fused_name_partial_name_and_typo(dumped):
    ws, npu, _ = dumped
    node, note = ops.find_op(ws, npu, "head/Softmax")
    assert node.name == "head/Softmax" and note == ""
    node, note = ops.find_op(ws, npu, "dense/MatMul")          # absorbed by the fusion
    assert "dense/MatMul" in node.attrs["original_op_names"]
    assert "was fused into" in note and "MatMulBiasAddFusionPass" in note
    with pytest.raises(WorkspaceError, match="op.s. whose name holds it: .*head/Softmax"):
        ops.find_op(ws, npu, "Soft")
    with pytest.raises(WorkspaceError, match="did you mean head/Softmax"):
        ops.find_op(ws, npu, "head/Softmx")


def test_subgraph_dot_keeps_the_ops_within_the_depth_and_escapes_names():
    from precision_tool.graph import NodeView
    nodes = [NodeView("a", "Placeholder", [], {}, []), NodeView('b"q', "Relu", ["a:0"], {}, []),
             NodeView("c", "Exp", ['b"q:0'], {}, []), NodeView("d", "Neg", ["c:0"], {}, [])]
    dot = ops.subgraph_dot(nodes, "c", 1)
    assert '"b\\"q" -> "c";' in dot and '"c" -> "d";' in dot
    assert '"a"' not in dot                                   # two hops away
    assert '"c" [label="c\\nExp", style=bold];' in dot
    assert '"a" -> "b\\"q";' in ops.subgraph_dot(nodes, "c", 2)


def test_export_subgraph_writes_the_dot_file_in_the_workspace(dumped):
    ws, npu, _ = dumped
    path = ops.export_subgraph(ws, npu, "act/Relu", 1)
    assert path.startswith(ws.root) and path.endswith("_1.dot")
    text = open(path, encoding="utf-8").read()
    assert '"act/Relu" -> "head/Softmax";' in text


def test_find_tensor_by_tensor_name_file_name_and_path(dumped, tmp_path):
    ws, npu, cpu = dumped
    found = ops.find_tensor(ws, "head/Softmax:0")
    assert found.run.label == npu.label and found.row["io"] == "output"
    assert found.label == f"{npu.label} head/Softmax:output:0"
    np.testing.assert_allclose(found.value.sum(axis=-1), 1.0, rtol=1e-3)   # rows of a softmax
    by_file = ops.find_tensor(ws, found.row["file"])
    np.testing.assert_array_equal(by_file.value, found.value)
    golden = ops.find_tensor(ws, "head/Softmax:output:0", run_spec=cpu.label, target="cpu")
    assert golden.run.label == cpu.label and golden.value.dtype == np.float32
    # any .npy outside the workspace is that file, read without unpickling
    outside = tmp_path / "mine.npy"
    np.save(outside, np.arange(3, dtype=np.float16))
    plain = ops.find_tensor(ws, str(outside))
    assert plain.run is None and plain.row is None and plain.dtype == "float16"
    with pytest.raises(WorkspaceError, match="did you mean head/Softmax"):
        ops.find_tensor(ws, "head/Softmx:0")
