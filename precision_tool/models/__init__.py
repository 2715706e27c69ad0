"""Reference models on the digits data: an MLP, a small CNN and a small Transformer encoder.

Each builder returns a `Model` bundle over its own graph: placeholders x [batch, 64] (pixels)
and y [batch] (int32 labels), the mean cross-entropy `loss`, the training-mode `logits`, the
inference-mode `eval_logits` (BatchNorm on moving statistics, no dropout) and `train_op`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from .. import nn, ops
from ..graph import Graph, Tensor, get_default_graph
from ..graph.ir import Node
from ..train import Adam, Optimizer


@dataclass
class Model:
    name: str
    graph: Graph
    x: Tensor
    y: Tensor
    loss: Tensor
    logits: Tensor
    eval_logits: Tensor
    train_op: Node

    @property
    def inputs(self):
        return self.x, self.y


class Network:
    """A network as a callable that builds its ops in the default graph, the shape a
    MindSpore Cell has: `net(x, training=True, reuse=False) -> logits`, x float32 [batch, 64].
    A second call with reuse=True builds another path over the same variables (the
    inference branch); `inference_differs` says whether that path computes anything else
    (BatchNorm on its moving statistics)."""

    def __init__(self, name: str, forward: Callable, inference_differs: bool = False):
        self.name, self._forward, self.inference_differs = name, forward, inference_differs

    def __call__(self, x: Tensor, training: bool = True, reuse: bool = False) -> Tensor:
        return self._forward(x, training, reuse)

    def __repr__(self):
        return f"Network({self.name!r})"


def _build(net: Network, optimizer: Optimizer, seed: int, batch_size: Optional[int]) -> Model:
    """Models whose inference differs from training get a second forward path over the same
    variables; the others share one."""
    g = Graph(net.name, seed=seed)
    with g.as_default():
        x = ops.placeholder("x", [batch_size, 64])
        y = ops.placeholder("y", [batch_size], "int32")
        logits = net(x, training=True, reuse=False)
        eval_logits = net(x, training=False, reuse=True) if net.inference_differs else logits
        with g.name_scope("loss"):
            loss = ops.reduce_mean(ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train_op = optimizer.minimize(loss)
    return Model(net.name, g, x, y, loss, logits, eval_logits, train_op)


def mlp_network(hidden: Sequence[int] = (64,)) -> Network:
    """64 -> hidden (ReLU) ... -> 10."""
    def forward(x, training, reuse):
        h = x
        for k, units in enumerate(hidden):
            h = nn.dense(h, units, activation=ops.relu, name=f"fc{k + 1}", reuse=reuse)
        return nn.dense(h, 10, name="logits", reuse=reuse)
    return Network("mlp", forward)


def cnn_network(channels: Sequence[int] = (16, 32)) -> Network:
    """[1, 8, 8] -> Conv3x3-BN-ReLU-MaxPool -> Conv3x3-BN-ReLU-AvgPool -> Dense 10 (NCHW)."""
    c1, c2 = channels

    def forward(x, training, reuse):
        h = ops.reshape(x, [-1, 1, 8, 8])
        h = nn.conv2d(h, c1, 3, use_bias=False, name="conv1", reuse=reuse)
        h = ops.relu(nn.batch_norm(h, training=training, name="bn1", reuse=reuse))
        h = ops.max_pool(h, 2)
        h = nn.conv2d(h, c2, 3, use_bias=False, name="conv2", reuse=reuse)
        h = ops.relu(nn.batch_norm(h, training=training, name="bn2", reuse=reuse))
        h = ops.avg_pool(h, 2)
        return nn.dense(ops.reshape(h, [-1, c2 * 4]), 10, name="logits", reuse=reuse)
    return Network("cnn", forward, inference_differs=True)


def transformer_network(d_model: int = 32, num_heads: int = 2, ff_units: int = 64,
                        layers: int = 1, embedding_norm: bool = False) -> Network:
    """Each image row is a token (8 tokens of 8 pixels): input projection + learned positions
    (Gather), with embedding_norm a LayerNorm over them as BERT's embeddings have, `layers`
    post-LN encoder blocks (multi-head self-attention, decomposed
    LayerNorm, GELU feed-forward), mean over tokens, classifier."""
    tokens, width = 8, 8

    def forward(x, training, reuse):
        h = nn.dense(ops.reshape(x, [-1, width]), d_model, name="input_projection", reuse=reuse)
        h = ops.reshape(h, [-1, tokens, d_model])
        positions = ops.constant(np.arange(tokens), dtype="int32", name="position_ids")
        h = ops.add(h, nn.embedding(positions, tokens, d_model, name="position_embedding",
                                    reuse=reuse))
        if embedding_norm:
            h = nn.layer_norm(h, name="embedding_norm", reuse=reuse)
        for k in range(layers):
            with get_default_graph().name_scope(f"encoder/layer_{k}"):
                att = nn.multi_head_attention(h, num_heads, name="attention", reuse=reuse)
                h = nn.layer_norm(ops.add(h, att), name="attention_norm", reuse=reuse)
                flat = ops.reshape(h, [-1, d_model])
                ff = nn.dense(flat, ff_units, activation=ops.gelu, name="intermediate", reuse=reuse)
                ff = nn.dense(ff, d_model, name="output", reuse=reuse)
                h = nn.layer_norm(ops.add(h, ops.reshape(ff, [-1, tokens, d_model])),
                                  name="output_norm", reuse=reuse)
        pooled = ops.reduce_mean(h, 1)
        return nn.dense(pooled, 10, name="classifier", reuse=reuse)
    return Network("transformer", forward)


def mlp(hidden: Sequence[int] = (64,), optimizer: Optional[Optimizer] = None, seed: int = 0,
        batch_size: Optional[int] = None) -> Model:
    """The MLP network (see mlp_network) with its loss and an Adam(0.01) step."""
    return _build(mlp_network(hidden), optimizer or Adam(0.01), seed, batch_size)


def cnn(channels: Sequence[int] = (16, 32), optimizer: Optional[Optimizer] = None, seed: int = 0,
        batch_size: Optional[int] = None) -> Model:
    """The CNN network (see cnn_network) with its loss and an Adam(0.01) step."""
    return _build(cnn_network(channels), optimizer or Adam(0.01), seed, batch_size)


def transformer(d_model: int = 32, num_heads: int = 2, ff_units: int = 64, layers: int = 1,
                optimizer: Optional[Optimizer] = None, seed: int = 0,
                batch_size: Optional[int] = None, embedding_norm: bool = False) -> Model:
    """The Transformer network (see transformer_network) with its loss and an Adam(0.003)
    step."""
    return _build(transformer_network(d_model, num_heads, ff_units, layers, embedding_norm),
                  optimizer or Adam(0.003), seed, batch_size)


def fit(sess, model: Model, data, epochs: int = 1, batch_size: int = 64, seed: int = 0,
        max_steps: Optional[int] = None) -> List[float]:
    """Train on data.batches; returns the loss of every step."""
    losses: List[float] = []
    for epoch in range(epochs):
        for xb, yb in data.batches(batch_size, seed=seed, epoch=epoch):
            if max_steps is not None and len(losses) >= max_steps:
                return losses
            loss, _ = sess.run([model.loss, model.train_op], {model.x: xb, model.y: yb})
            losses.append(float(loss))
    return losses


def accuracy(sess, model: Model, x: np.ndarray, y: np.ndarray) -> float:
    """Share of examples whose inference-mode arg-max logit is the label."""
    logits = sess.run(model.eval_logits, {model.x: x})
    return float(np.mean(np.argmax(logits, axis=1) == y))


__all__ = ["Model", "Network", "mlp", "cnn", "transformer", "mlp_network", "cnn_network",
           "transformer_network", "fit", "accuracy"]
