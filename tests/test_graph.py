"""The IR: names, scopes, topological order, JSON round trip and load-time validation."""
import json

import numpy as np
import pytest

import precision_tool as pt
from precision_tool.graph import graph_from_json, graph_to_json


def _small():
    g = pt.Graph("small", seed=3)
    with g.as_default():
        x = pt.placeholder("x", [None, 4])
        with pt.name_scope("encoder"):
            with pt.name_scope("layer_0"):
                w = pt.variable("w", [4, 4])
                a = pt.ops.matmul(x, w)
                b = pt.ops.matmul(a, w)
        c = pt.ops.relu(b)
    return g, x, w, a, b, c


def test_names_are_scoped_and_made_unique_tf_style():
    g, x, w, a, b, c = _small()
    assert w.node.name == "encoder/layer_0/w"
    assert a.node.name == "encoder/layer_0/MatMul"
    assert b.node.name == "encoder/layer_0/MatMul_1"
    assert c.node.name == "Relu"
    assert c.name == "Relu:0"
    with g.as_default():
        with pt.name_scope("encoder"):
            d = pt.ops.relu(c)
            with pt.name_scope("/"):     # a name ending in '/' replaces the scope
                e = pt.ops.relu(d)
    assert d.node.name == "encoder/Relu" and e.node.name == "Relu_1"


def test_variable_names_are_never_silently_changed():
    g = pt.Graph("v")
    with g.as_default():
        pt.variable("w", [2])
        with pytest.raises(pt.GraphError, match="'w' already exists"):
            pt.variable("w", [2])


def test_building_outside_a_graph_says_how():
    with pytest.raises(pt.GraphError, match="as_default"):
        pt.placeholder("x", [1])


def test_topological_order_follows_data_not_insertion():
    g, *_ = _small()
    text = graph_to_json(g)
    data = json.loads(text)
    data["nodes"].reverse()            # a loaded graph may list consumers first
    loaded = pt.graph.graph_from_dict(data)
    order = [n.name for n in loaded.topological_order()]
    for n in loaded.nodes:
        for inp in n.inputs:
            assert order.index(inp.rpartition(":")[0]) < order.index(n.name)


def test_json_round_trips_exactly_for_every_model(tmp_path):
    for build in (pt.models.mlp, pt.models.cnn, pt.models.transformer):
        m = build()
        text = graph_to_json(m.graph)
        path = tmp_path / f"{m.name}.json"
        pt.save_graph(m.graph, str(path))
        loaded = pt.load_graph(str(path))
        assert graph_to_json(loaded) == text
        assert [n.name for n in loaded.nodes] == [n.name for n in m.graph.nodes]
        assert loaded.collections == m.graph.collections


def test_a_loaded_graph_computes_what_the_original_does(tmp_path):
    m = pt.models.cnn()
    pt.save_graph(m.graph, str(tmp_path / "g.json"))
    loaded = pt.load_graph(str(tmp_path / "g.json"))
    d = pt.data.digits()
    feed = {"x:0": d.x_train[:16], "y:0": d.y_train[:16]}
    fetches = [m.loss.name, m.train_op.name, m.logits.name]
    want = pt.Session(m.graph).run(fetches, feed)
    got = pt.Session(loaded).run(fetches, feed)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])


def test_constants_round_trip_bit_exactly():
    g = pt.Graph("c")
    values = np.array([0.1, -1e-30, 3.4e38, np.pi, 2 ** -24], dtype=np.float32)
    with g.as_default():
        c = pt.constant(values)
    loaded = graph_from_json(graph_to_json(g))
    out = pt.Session(loaded).run(c.name)
    np.testing.assert_array_equal(out, values)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["nodes"][2].update(type="NoSuchOp"), "unknown type 'NoSuchOp'"),
    (lambda d: d["nodes"][2].update(inputs=["ghost:0", "w:0"]), "'ghost:0', which no op produces"),
    (lambda d: d["nodes"][1].update(inputs=["MatMul:0"], type="Relu",
                                    attrs={}), "cycle"),
    (lambda d: d["nodes"][2]["outputs"][0].update(shape=[None, 7]), "declares outputs"),
    (lambda d: d["nodes"][2].update(attrs={"transpose_a": False, "transpose_b": True}),
     "inner dimensions differ"),
    (lambda d: d.update(format="something else"), "not a precision_tool graph"),
    (lambda d: d["nodes"].append(dict(d["nodes"][0])), "duplicate op name"),
    (lambda d: d["nodes"][0].pop("type"), "malformed"),
])
def test_bad_graph_json_is_refused_with_the_op_named(tmp_path, mutate, message):
    g = pt.Graph("bad")
    with g.as_default():
        x = pt.placeholder("x", [None, 3])
        w = pt.variable("w", [3, 2])
        pt.ops.matmul(x, w)
    data = json.loads(graph_to_json(g))
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(pt.GraphFormatError, match=message):
        pt.load_graph(str(path))


def test_unparseable_and_missing_graph_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "precision_tool.graph", "nodes": [')
    with pytest.raises(pt.GraphFormatError, match="does not parse"):
        pt.load_graph(str(bad))
    with pytest.raises(pt.GraphFormatError, match="cannot read graph file"):
        pt.load_graph(str(tmp_path / "missing.json"))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(pt.GraphFormatError):
        pt.load_graph(str(binary))


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path, monkeypatch):
    g, *_ = _small()
    target = tmp_path / "g.json"
    pt.save_graph(g, str(target))
    before = target.read_text()
    import precision_tool.fileio as fileio

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fileio.os, "fsync", boom)
    with g.as_default():
        pt.ops.relu(g.node("Relu").output(0))
    with pytest.raises(OSError):
        pt.save_graph(g, str(target))
    assert target.read_text() == before          # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["g.json"]
