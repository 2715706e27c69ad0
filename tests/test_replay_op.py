"""Single-op replay (groundwork): an op's own error versus the error it inherited."""
import numpy as np
import pytest

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis import ReplayOpError, replay_op
from precision_tool.dump import Workspace


def _dump(tmp_path, graph, feed, **kw):
    npu = pt.Session(graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(**kw), action="dump", data_dir=str(tmp_path)))
    cpu = hooks.sess_dump(pt.Session(graph), action="dump", data_dir=str(tmp_path))
    fetch = [n for n in graph.nodes][-1].output(0)
    npu.run(fetch, feed)
    cpu.run(fetch, feed)
    ws = Workspace(str(tmp_path))
    return ws, ws.run("npu"), ws.run("cpu")


def test_a_long_k_fp16_matmul_shows_local_error(tmp_path):
    g = pt.Graph("longk")
    with g.as_default():
        a = pt.placeholder("a", [8, 4096])
        b = pt.placeholder("b", [4096, 8])
        y = pt.ops.matmul(a, b, name="mm")
        pt.ops.relu(y, name="out")
    rng = np.random.default_rng(0)
    feed = {a: rng.uniform(0, 1, (8, 4096)).astype(np.float32),
            b: rng.uniform(0, 1, (4096, 8)).astype(np.float32)}
    ws, npu_run, cpu_run = _dump(tmp_path, g, feed, precision_mode="force_fp16", fusion_switch="off")
    r = replay_op(ws, npu_run, 0, "mm", cpu_run)
    # its own error: the fp16 output rounding of values near 1024 (a 0.5 grid)
    assert r.own["MaxAbsoluteError"] > 0.01 and r.own["MeanRelativeError"] > 5e-5
    assert r.own["MaxRelativeError"] <= 2.0 ** -11 * 1.001
    assert r.verdict == "local"          # more than the fp16 rounding of its inputs explains
    # the relu after it only carries what it was given: no error of its own
    relu = replay_op(ws, npu_run, 0, "out", cpu_run)
    assert relu.own["MaxAbsoluteError"] == 0.0 and relu.verdict == "inherited"


def test_a_fused_layer_norm_replays_its_original_ops(tmp_path):
    g = pt.Graph("ln")
    with g.as_default():
        x = pt.placeholder("x", [None, 64], "float16")
        y = pt.nn.layer_norm(pt.ops.mul(x, 1.0), name="norm")
        pt.ops.relu(y, name="out")
    xv = (100 + np.random.default_rng(1).normal(size=(16, 64))).astype(np.float16)
    ws, npu_run, cpu_run = _dump(tmp_path, g, {x: xv}, precision_mode="allow_mix_precision")
    r = replay_op(ws, npu_run, 0, "norm/Add_1", cpu_run)
    assert r.output == "norm/Add_1:0"
    assert r.verdict == "local"                       # the fused kernel's own numerics
    assert r.inherited["CosineSimilarity"] > 0.9999   # its inputs were fine
    with pytest.raises(ReplayOpError, match="not in the dump"):
        replay_op(ws, npu_run, 0, "nope", cpu_run)
