"""ONNX models for the import tests.

Small ones are built here with onnx.helper, each for one behaviour. The real ones are
architectures someone else wrote, exported with random weights by torch's exporter when torch
is installed (`pip install -e '.[onnx-export]'`): torchvision's ResNet-18 and a 2-layer BERT
encoder from transformers. Exports are cached per test session by the callers."""
import importlib.util

import numpy as np
from onnx import TensorProto, helper, numpy_helper

EXPORT_PACKAGES = ("torch", "torchvision", "transformers", "onnxscript")


def missing_export_packages():
    return [p for p in EXPORT_PACKAGES if importlib.util.find_spec(p) is None]


def model(nodes, inputs, outputs, initializers=(), opset=17, name="test_model"):
    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = min(m.ir_version, 8)      # readable by every onnx/onnxruntime installed
    return m


def value(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def mlp(scale=1.0, seed=0):
    """x[batch, 8] -> Gemm -> Relu -> MatMul + bias -> Softmax, node names as PyTorch's
    exporter writes them ('/fc1/Gemm'). `scale` multiplies the second layer's weights: at
    2e3 its outputs leave fp16's range."""
    r = np.random.default_rng(seed)
    w1 = r.normal(0, 0.5, (16, 8)).astype(np.float32)
    b1 = r.normal(0, 0.1, 16).astype(np.float32)
    w2 = (r.normal(0, 0.5, (16, 4)) * scale).astype(np.float32)
    b2 = r.normal(0, 0.1, 4).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["/fc1/Gemm_output_0"],
                         name="/fc1/Gemm", transB=1),
        helper.make_node("Relu", ["/fc1/Gemm_output_0"], ["/act/Relu_output_0"], name="/act/Relu"),
        helper.make_node("MatMul", ["/act/Relu_output_0", "fc2.weight"], ["/fc2/MatMul_output_0"],
                         name="/fc2/MatMul"),
        helper.make_node("Add", ["/fc2/MatMul_output_0", "fc2.bias"], ["logits"], name="/fc2/Add"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="/Softmax", axis=-1),
    ]
    return model(nodes, [value("x", ["batch", 8])], [value("probs", ["batch", 4])],
                 [init("fc1.weight", w1), init("fc1.bias", b1), init("fc2.weight", w2),
                  init("fc2.bias", b2)])


def folding():
    """x[n, 2, 3] reshaped by its own Shape (Shape, Gather, Unsqueeze, Concat) plus offsets
    that a Mod of two initializers computes: everything but the Reshape and the Add folds."""
    nodes = [
        helper.make_node("Mod", ["a", "b"], ["offs"], name="mod", fmod=0),
        helper.make_node("Cast", ["offs"], ["offs_f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], name="batch", axis=0),
        helper.make_node("Unsqueeze", ["batch", "zero1"], ["batch1"], name="unsq"),
        helper.make_node("Concat", ["batch1", "minus1"], ["newshape"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "newshape"], ["flat"], name="/reshape/Reshape"),
        helper.make_node("Add", ["flat", "offs_f"], ["y"], name="/add/Add"),
    ]
    inits = [init("a", np.arange(6, dtype=np.int64)), init("b", np.array(4, np.int64)),
             init("zero", np.array(0, np.int64)), init("zero1", np.array([0], np.int64)),
             init("minus1", np.array([-1], np.int64))]
    return model(nodes, [value("x", ["n", 2, 3])], [value("y", ["n", 6])], inits)


def opset11():
    """Squeeze, Unsqueeze and ReduceMean with their axes as attributes (before opset 13)."""
    nodes = [helper.make_node("Squeeze", ["x"], ["s"], name="sq", axes=[1]),
             helper.make_node("Unsqueeze", ["s"], ["u"], name="unsq", axes=[0]),
             helper.make_node("ReduceMean", ["u"], ["y"], name="mean", axes=[2], keepdims=0)]
    return model(nodes, [value("x", [3, 1, 4])], [value("y", [1, 3])], opset=11)


def export_resnet18(path, seed=0):
    """torchvision's ResNet-18, random weights, exported at 224x224 (batch free)."""
    import torch
    import torchvision
    torch.manual_seed(seed)
    net = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 224, 224)
    torch.onnx.export(net, (x,), str(path), input_names=["image"], output_names=["logits"],
                      dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=64)}},
                      dynamo=True, verbose=False)
    return str(path)


BERT_SEQ = 16


def export_bert(path, seed=0):
    """A BERT encoder from transformers (2 layers, hidden 64, 4 heads, vocabulary 1000),
    random weights, its default attention, exported with input_ids and attention_mask
    [1, 16]."""
    import torch
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=64)
    net = BertModel(config).eval()
    ids = torch.randint(0, 1000, (1, BERT_SEQ))
    mask = torch.ones(1, BERT_SEQ, dtype=torch.long)
    torch.onnx.export(net, (), str(path), kwargs={"input_ids": ids, "attention_mask": mask},
                      dynamo=True, verbose=False)
    return str(path)


def bert_inputs(padding=4, seed=0):
    """input_ids and an attention_mask whose last `padding` tokens are padding."""
    r = np.random.default_rng(seed)
    mask = np.ones((1, BERT_SEQ), np.int64)
    if padding:
        mask[:, -padding:] = 0
    return {"input_ids": r.integers(0, 1000, (1, BERT_SEQ)).astype(np.int64),
            "attention_mask": mask}
