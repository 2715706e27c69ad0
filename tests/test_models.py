"""The reference models: structure that later layers rely on, and training on real data."""
import collections

import numpy as np
import pytest

import precision_tool as pt


@pytest.fixture(scope="module")
def digits():
    return pt.data.digits()


def test_digits_ships_with_the_package_and_splits_reproducibly(digits):
    assert digits.x_train.shape == (1438, 64) and digits.x_test.shape == (359, 64)
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int32
    assert 0.0 <= digits.x_train.min() and digits.x_train.max() == 1.0
    assert set(np.unique(digits.y_test)) == set(range(10))
    again = pt.data.digits()
    np.testing.assert_array_equal(again.x_test, digits.x_test)
    raw = pt.data.digits(scale=1.0, images=True)
    assert raw.x_train.shape == (1438, 1, 8, 8) and raw.x_train.max() == 16.0
    batches = list(digits.batches(100, seed=0, epoch=0))
    assert len(batches) == 14 and all(xb.shape == (100, 64) for xb, _ in batches)
    assert not np.array_equal(batches[0][1], next(digits.batches(100, seed=0, epoch=1))[1])
    with pytest.raises(ValueError, match="test_fraction"):
        pt.data.digits(test_fraction=1.5)


def _types(model):
    return collections.Counter(n.type for n in model.graph.nodes)


def test_transformer_holds_the_ops_the_npu_passes_look_for():
    m = pt.models.transformer()
    types = _types(m)
    for op in ("MatMul", "BiasAdd", "BatchMatMul", "Softmax", "Gelu", "Gather", "Rsqrt",
               "SparseSoftmaxCrossEntropyWithLogits", "ApplyAdam", "GeluGrad"):
        assert types[op] > 0, op
    # LayerNorm decomposed exactly as TF holds it: ReduceMean, Sub, Square, ReduceMean, Add eps,
    # Rsqrt, Mul, Mul, Add
    scope = "encoder/layer_0/attention_norm/"
    ln = [n.type for n in m.graph.nodes if n.name.startswith(scope) and n.type != "Variable"
          and n.type != "Const"]
    assert ln == ["ReduceMean", "Sub", "Square", "ReduceMean", "Add", "Rsqrt", "Mul", "Mul", "Add"]
    names = {n.name for n in m.graph.nodes}
    assert "encoder/layer_0/attention/query/MatMul" in names
    assert "gradients/encoder/layer_0/attention/query/MatMul_grad/MatMul_1" in names
    assert "Adam/update_classifier/kernel/ApplyAdam" in names


def test_cnn_uses_conv_pool_and_batch_norm_with_moving_statistics():
    m = pt.models.cnn()
    types = _types(m)
    for op in ("Conv2D", "MaxPool", "AvgPool", "BatchNorm", "Conv2DBackpropFilter",
               "Conv2DBackpropInput", "MaxPoolGrad", "AvgPoolGrad", "BatchNormGrad",
               "AssignMovingAverage"):
        assert types[op] > 0, op
    train_inputs = set(m.train_op.inputs)
    for update in m.graph.get_collection("update_ops"):
        assert f"{update.name}:0" in train_inputs
    # the inference branch normalises with the moving statistics, not the batch's
    eval_bn = [n for n in m.graph.nodes if n.type == "BatchNorm" and not n.attrs["is_training"]]
    assert len(eval_bn) == 2 and all(n.inputs[3].endswith("moving_mean:0") for n in eval_bn)


@pytest.mark.parametrize("build, epochs, floor", [
    (pt.models.mlp, 10, 0.93),
    (pt.models.cnn, 5, 0.95),
    (pt.models.transformer, 10, 0.9),
])
def test_model_learns_digits_on_the_golden_executor(digits, build, epochs, floor):
    m = build()
    sess = pt.Session(m.graph)
    before = pt.models.accuracy(sess, m, digits.x_test, digits.y_test)
    losses = pt.models.fit(sess, m, digits, epochs=epochs, batch_size=32)
    after = pt.models.accuracy(sess, m, digits.x_test, digits.y_test)
    assert before < 0.3
    assert np.mean(losses[-20:]) < 0.25 * losses[0]
    assert after >= floor, f"{m.name}: held-out accuracy {after:.4f} < {floor}"


def test_batch_norm_moving_statistics_track_the_data(digits):
    m = pt.models.cnn()
    sess = pt.Session(m.graph)
    pt.models.fit(sess, m, digits, epochs=1, batch_size=64)
    state = sess.variables()
    assert not np.allclose(state["bn1/moving_mean"], 0)
    assert not np.allclose(state["bn1/moving_variance"], 1)
