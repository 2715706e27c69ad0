"""The simulated NPU under a PyTorch script, at the kernel level: every aten op the script
runs (forward, backward, optimizer) goes through the graph executor's precision policy
(runtime.npu.policy.Policy.decide) under a TorchDispatchMode.

An op the policy computes in fp16 or bf16 gets its float inputs on that grid, computes in
float32 (the Cube unit's fp32 accumulation, the Vector unit's fp32 arithmetic) and its
result rounded to the grid, saturated or inf/nan by the overflow mode, with the status word
set as the executor sets it (kernels.round_result, the executor's own rounding). Tensors
stay float32 holding the device's values, as the graph executor holds them; `dtype_of`
says which dtype a tensor has on the device. View and shape ops compute nothing and pass;
an op the table below does not classify runs as the script asked and, where it reads or
makes a float tensor, is listed once in `unclassified` (run.json's "not_simulated", which
torch-run and ac print).

Kernels the device runs as one fused kernel of a fusion pass (`FUSED`: layer norm, RMS norm,
softmax, GELU, a matmul with its bias, attention) use that kernel's numerics, the graph
executor's own (ops.fused_ops: the one-pass variance, the RMS norm's float32 squares, softmax
without the max subtraction in fp16, the tanh GELU, the bias added in the accumulator),
while the pass is on in the fusion switch; with it off, the op the pass would have fused
runs instead: torch's own decomposition, each of its kernels through the policy, or the
unfused op itself (erf GELU, softmax); attention (the flash kernel) as torch's math
attention, its backward as the unfused ops'. A call torch takes apart before any kernel
(F.rms_norm) reaches the mode as one kernel through `call` (fused_calls). `fired` names
the passes a call's kernels used, for its fusion record."""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Set

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import numerics
from ..kernels import round_result
from ..ops import REGISTRY
from ..ops.registry import KernelContext
from ..runtime.npu.fusion import enabled_passes
from ..runtime.npu.policy import make_policy
from .fused_calls import FUSED_CALLS, row_shape

# aten op (its overload packet's name) -> the graph IR's op type the policy decides by: one
# table, declarative. Cube ops are the policy's white list's (MatMul, Conv2D...).
OP_TYPES: Dict[str, str] = {
    "mm": "MatMul", "addmm": "MatMul", "bmm": "BatchMatMul", "baddbmm": "BatchMatMul",
    "convolution": "Conv2D", "convolution_backward": "Conv2DBackpropInput",
    "exp": "Exp", "log": "Log", "pow": "Pow", "sqrt": "Sqrt", "rsqrt": "Rsqrt",
    "sum": "ReduceSum", "mean": "ReduceMean", "_log_softmax": "LogSoftmax",
    "_log_softmax_backward_data": "LogSoftmax", "nll_loss_forward": "SparseSoftmaxCrossEntropyWithLogits",
    "nll_loss_backward": "SparseSoftmaxCrossEntropyWithLogits",
    "native_layer_norm": "LayerNorm", "native_layer_norm_backward": "LayerNorm",
    # F.rms_norm as one kernel (fused_calls: the NPU run calls it while its pass is on)
    "rms_norm": "RmsNorm", "rms_norm_backward": "RmsNorm",
    "native_batch_norm": "BatchNorm", "native_batch_norm_backward": "BatchNormGrad",
    "_softmax": "Softmax", "_safe_softmax": "Softmax", "_softmax_backward_data": "Softmax",
    "gelu": "Gelu", "gelu_backward": "GeluGrad", "relu": "Relu", "threshold_backward": "ReluGrad",
    "tanh": "Tanh", "tanh_backward": "TanhGrad", "sigmoid": "Sigmoid",
    "sigmoid_backward": "SigmoidGrad", "silu": "Silu", "silu_backward": "SiluGrad",
    "add": "Add", "sub": "Sub", "mul": "Mul", "div": "RealDiv", "neg": "Neg", "abs": "Abs",
    "maximum": "Maximum", "minimum": "Minimum", "where": "Select", "clamp": "ClipByValue",
    "addcmul": "Mul", "addcdiv": "RealDiv", "lerp": "Add", "amax": "ReduceMax",
    "max": "ReduceMax", "embedding": "Gather", "embedding_dense_backward": "GatherGrad",
    "masked_fill": "Select", "dropout": "Dropout", "native_dropout": "Dropout",
    "native_dropout_backward": "Mul", "scatter_add": "GatherGrad", "index_select": "Gather",
    "cat": "ConcatV2", "stack": "Pack", "cumsum": "Cumsum", "var_mean": "ReduceMean",
    "max_pool2d_with_indices": "MaxPool", "max_pool2d_with_indices_backward": "MaxPoolGrad",
    "avg_pool2d": "AvgPool", "avg_pool2d_backward": "AvgPoolGrad", "reciprocal": "Reciprocal",
    "_adaptive_avg_pool2d": "AvgPool", "_adaptive_avg_pool2d_backward": "AvgPoolGrad",
    # GroupNorm: statistics per sample, as LayerNorm's (the norm family, gray-listed)
    "native_group_norm": "LayerNorm", "native_group_norm_backward": "LayerNorm",
    "rsub": "Sub", "mse_loss": "ReduceMean", "mse_loss_backward": "Sub",
    # an upsampling's backward sums the gradients of the pixels each input made; a bilinear
    # one weighs neighbours: the pooling ops' kinds (a nearest upsampling copies: PASSIVE)
    "upsample_nearest2d_backward": "AvgPool", "upsample_bilinear2d": "AvgPool",
    "upsample_bilinear2d_backward": "AvgPoolGrad",
    # clip_grad_norm_'s norms (black list: float32) and its scaling of every gradient
    "linalg_vector_norm": "ReduceSum", "_foreach_norm": "ReduceSum", "_foreach_mul": "Mul",
    "_foreach_mul_": "Mul", "sin": "Sin", "cos": "Cos", "remainder": "FloorMod",
    "hardswish": "HardSwish", "hardswish_backward": "HardSwishGrad",
    "hardsigmoid": "HardSigmoid", "hardsigmoid_backward": "HardSigmoidGrad",
    # a mixture of experts' routing: rows summed into place (index_add_, index_put with
    # accumulate, an indexing's backward), as scatter_add
    "index_add": "GatherGrad", "index_put": "GatherGrad",
    # F.scaled_dot_product_attention: one fused Cube kernel on the device (Ascend's
    # FlashAttentionScore), placed as the white list's BatchMatMul; inside it computes in
    # float32 (torch's CPU flash kernel: the scores, their softmax and the product in
    # float32), one rounding of its output at the end
    "_scaled_dot_product_flash_attention_for_cpu": "BatchMatMul",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "BatchMatMul",
}
# kernels whose outputs (by position) or arguments stay float32 on the device whatever the
# policy places: the fused attention's log-sum-exp (its softmax statistics, which its
# backward reads back)
# (and the RMS norm's rstd)
FP32_OUTPUTS: Dict[str, tuple] = {"_scaled_dot_product_flash_attention_for_cpu": (1,),
                                  "rms_norm": (1,)}
FP32_ARGS: Dict[str, tuple] = {"_scaled_dot_product_flash_attention_for_cpu_backward": (5,),
                               "rms_norm_backward": (3,)}
# a norm's backward: its weight and bias gradients (positions) are sums over the batch, which
# cancellation can make small (the compare's sum kinds, by the kernel that made an output)
SUM_OUTPUTS: Dict[str, tuple] = {"native_batch_norm_backward": (1, 2),
                                 "native_layer_norm_backward": (1, 2),
                                 "native_group_norm_backward": (1, 2)}
CUBE = frozenset({"MatMul", "BatchMatMul", "Conv2D", "Conv2DBackpropInput"})
# ops that compute nothing: views, copies, shape and creation ops keep their inputs' values
PASSIVE = frozenset({
    "t", "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "squeeze",
    "unsqueeze", "detach", "clone", "contiguous", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind", "as_strided", "alias", "lift_fresh", "ones_like", "zeros_like",
    "empty_like", "full_like", "zeros", "ones", "empty", "full", "arange", "linspace", "copy_",
    "_to_copy",
    "fill_", "zero_", "new_zeros", "new_ones", "new_empty", "new_full", "scalar_tensor",
    "_record_function_enter_new", "_record_function_exit", "expand_as", "view_as", "flatten",
    "is_nonzero", "item", "_local_scalar_dense", "eq", "ne", "lt", "le", "gt", "ge", "argmax",
    "randint", "randn", "rand", "normal_", "uniform_", "bernoulli_", "random_", "set_",
    "resize_", "_reshape_alias", "unfold", "index", "gather", "nonzero", "sort", "topk",
    "logical_not", "logical_and", "logical_or", "isnan", "isinf", "isfinite", "all", "any",
    "sign", "bitwise_and", "bitwise_or", "_foreach_add_", "diagonal", "tril", "triu",
    "constant_pad_nd", "new_empty_strided", "empty_strided", "repeat", "roll", "flip",
    "upsample_nearest2d", "unsafe_split", "scatter",
    "index_put_", "_unsafe_index", "split_with_sizes_copy", "select_backward",
    "slice_backward", "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_",
    "to",
})
# aten kernel -> (the fusion pass that makes it one fused kernel on the device, the fused
# op type whose kernel (ops.fused_ops) computes it while the pass is on: None where torch's
# own kernel already computes as the fused one does, one rounding at the end). With the pass
# off: torch's decomposition where `_DECOMPOSED` has one, else the op as torch computes it.
FUSED: Dict[str, tuple] = {
    "native_layer_norm": ("LayerNormFusionPass", "LayerNorm"),
    "native_layer_norm_backward": ("LayerNormFusionPass", None),
    "rms_norm": ("RmsNormFusionPass", "RmsNorm"),
    "rms_norm_backward": ("RmsNormFusionPass", None),   # in float32 inside, one rounding
    "_softmax": ("SoftmaxFusionPass", "SoftmaxV2"),
    "gelu": ("GeluFusionPass", "FastGelu"),
    "gelu_backward": ("GeluFusionPass", None),     # the tanh GELU's own gradient
    "addmm": ("MatMulBiasAddFusionPass", None),    # the bias added in the fp32 accumulator
    # attention: the scores, their softmax and the product inside one kernel, in float32
    "_scaled_dot_product_flash_attention_for_cpu": ("FlashAttentionFusionPass", None),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("FlashAttentionFusionPass", None),
}
_LOW = (torch.float16, torch.bfloat16)
_ATEN = torch.ops.aten


def _host(t: torch.Tensor) -> np.ndarray:
    """t's values in host memory, for the numpy kernels: its own memory on the CPU, a copy
    of a CUDA tensor's."""
    return t.detach().cpu().numpy()


class ByIdentity:
    """A tensor -> value table by identity while the tensor lives (tensors compare element by
    element, so a WeakKeyDictionary cannot hold them); dead entries go when the table grows."""

    def __init__(self):
        self._d: Dict[int, tuple] = {}

    def get(self, t):
        entry = self._d.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def items(self):
        """(tensor, value) of every entry whose tensor lives."""
        for ref, value in list(self._d.values()):
            t = ref()
            if t is not None:
                yield t, value

    def __setitem__(self, t, value) -> None:
        if len(self._d) > 4096 and len(self._d) % 4096 == 0:
            self._d = {k: e for k, e in self._d.items() if e[0]() is not None}
        self._d[id(t)] = (weakref.ref(t), value)


def packet_name(func) -> str:
    name = getattr(getattr(func, "overloadpacket", None), "__name__", None) or str(func)
    return name.split(".")[-1]


class SimulatedNPU(TorchDispatchMode):
    """The dispatch mode that computes each kernel as the device would (see the module).
    config: a runtime.SessionConfig (its precision mode, amp level, mixlist, overflow
    mode). status: the OR of every kernel's status word since the last clear."""

    def __init__(self, config):
        super().__init__()
        self.policy = make_policy(config.precision_mode, config.amp_level, config.modify_mixlist)
        self.passes = frozenset(enabled_passes(config.fusion_switch_spec))
        self.fired: Set[str] = set()   # passes whose fused kernels ran since the last clear
        self.saturation = config.overflow_mode == "saturation"
        self.status = 0
        self.unclassified: Set[str] = set()
        # the device's dtype of each tensor the simulated kernels made (float16, bfloat16,
        # float32), by identity while the tensor lives
        self._dtypes = ByIdentity()
        # the IR op type of the kernel that made each tensor (a view: its input's), by
        # identity: what a call's outputs are (a sum, a contraction) for the compare
        self._kernels = ByIdentity()
        self.updating = False      # the optimizer's step: updates keep the declared dtype
        # the dtypes of the calls running now that set what their kernels compute in (its
        # forward, or its backward's node), innermost last: "float32" for a call kept in
        # fp32 (its kernels compute and keep float32, whatever the policy would place), a
        # low dtype for a fused call run unfused on tensors of that dtype (inside_dtype)
        self.inside: List[str] = []

    def call(self, func, args, kwargs):
        """An API call as the device runs it: one that torch takes apart above the dispatcher
        and the device runs as one fused kernel (F.rms_norm) is that kernel while its pass
        is on (fused_calls). A recurrent layer's (nn.LSTM, nn.GRU, nn.RNN) runs with oneDNN
        off: with it, torch's CPU computes a whole layer, forward and backward, as one
        kernel (mkldnn_rnn_layer) the policy cannot see into, which would run in the
        script's dtype, not simulated; without it, each time step is the cell's matmuls and
        gate activations, kernels the policy places like any other."""
        fused = FUSED_CALLS.get(func)
        if fused is not None and fused[0] in self.passes:
            return fused[1](*args, **kwargs)
        if func in _RECURRENT_CALLS and torch._C._get_mkldnn_enabled():
            torch._C._set_mkldnn_enabled(False)
            try:
                return func(*args, **kwargs)
            finally:
                torch._C._set_mkldnn_enabled(True)
        return func(*args, **kwargs)

    def inside_dtype(self, func, args) -> Optional[str]:
        """The dtype an API call's kernels compute in where the call sets it, else None:
        F.scaled_dot_product_attention on fp16 or bf16 queries. Torch's CPU takes such a
        call with dropout (or a mask its flash kernel refuses) through its math path, which
        casts the tensors up to float32 and the result back; the policy would then place
        those inner float32 matmuls in the mode's own low dtype (fp16 in a bf16 script,
        whose range flushed a BERT's key gradients to zero). On the device, with
        FlashAttentionFusionPass on, it is one FlashAttentionScore on the script's tensors,
        float32 inside: "float32", the call runs as one kept in fp32 (its backward too).
        With the pass off it is the ops the kernel fuses, on the script's tensors: the
        queries' dtype, what the inner float32 kernels are taken to be declared in. torch's
        casts put the call's inputs and outputs on their grid."""
        if func not in _ATTENTION_CALLS or not args or not isinstance(args[0], torch.Tensor) \
                or args[0].dtype not in _LOW:
            return None
        if "FlashAttentionFusionPass" in self.passes:
            return "float32"
        return str(args[0].dtype).replace("torch.", "")

    def kernel_of(self, t: torch.Tensor) -> str:
        """The op type of the kernel that made t ("" where none the table classifies)."""
        return self._kernels.get(t) or ""

    def dtype_of(self, t: torch.Tensor) -> Optional[str]:
        """The dtype a tensor has on the device: what the policy rounded it to, else its own."""
        return self._dtypes.get(t) or str(t.dtype).replace("torch.", "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = packet_name(func)
        fused = FUSED.get(name)
        if name == "_softmax" and args[1] % args[0].dim() != args[0].dim() - 1:
            fused = None            # the pass fuses a softmax over the last axis only
        if fused is not None:
            if fused[0] not in self.passes:
                if func in _DECOMPOSED:
                    # its decomposition's kernels come back through this mode one by one
                    with self:
                        return _DECOMPOSED[func](*args, **kwargs)
                fused = None
            else:
                self.fired.add(fused[0])
                if name == "gelu_backward":
                    kwargs = dict(kwargs, approximate="tanh")
        # an in-place variant (add_, the optimizer's) is its op, as an update
        op_type = OP_TYPES.get(name) or OP_TYPES.get(name.rstrip("_"))
        if op_type is None:
            if name not in PASSIVE:
                if torch._C._dispatch_has_kernel_for_dispatch_key(
                        func.name(), "CompositeImplicitAutograd"):
                    # a composite op a decomposition here called (the unfused attention's
                    # matmul): its pieces are the kernels
                    with self:
                        return func.decompose(*args, **kwargs)
                out = func(*args, **kwargs)
                # (on integers or booleans alone an op computes exactly: nothing to simulate)
                if any(t.is_floating_point() for t in tensors_in(args, kwargs, out)):
                    self.unclassified.add(f"aten.{name}")
                return out
            out = func(*args, **kwargs)
            # a view or copy holds its input's values: and its dtype on the device, where it
            # keeps the input's torch dtype
            first = next((a for a in tensors_in(args, kwargs) if a.is_floating_point()), None)
            low = self._dtypes.get(first) if first is not None else None
            made = self._kernels.get(first) if first is not None else None
            if low is not None or made is not None:
                def tag(t):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        # (a cast, `.float()` of a bf16 tensor, is a tensor of its own dtype)
                        if low is not None and t.dtype == first.dtype:
                            self._dtypes[t] = low
                        if made is not None:
                            self._kernels[t] = made
                    return t
                _map(tag, out)
            return out
        floats = [a for a in tensors_in(args, kwargs) if a.is_floating_point()]
        if not floats or all(a.dtype == torch.float64 for a in floats):
            # no float, or float64 the script asked for (GradScaler's 1/scale): as asked
            return func(*args, **kwargs)
        declared = _declared(floats)
        update = self.updating or name.endswith("_")
        written = args[0] if name.endswith("_") and not name.endswith("__") and args else None
        if isinstance(written, torch.Tensor) and written.is_floating_point():
            # an in-place write keeps its tensor's dtype (a float32 sum that adds a bf16
            # value computes in float32): computed in the other's low dtype it would be
            # computed on a copy, and the write lost
            declared = str(written.dtype).replace("torch.", "")
        inside = self.inside[-1] if self.inside else None
        if inside == "float32" and not update:
            compute = output = "float32"
        else:
            votes = [self.dtype_of(a) for a in floats]
            if inside is not None and declared == "float32" and not update:
                # a fused call's decomposition on the script's low-precision tensors, which
                # torch computes upcast: its float32 is that dtype on the device (an
                # in-place write, dropout's mask scaled, stays in its tensor's dtype)
                declared = inside
                votes = [inside if v == "float32" else v for v in votes]
            decided = self.policy.decide(op_type, declared, votes, op_type in CUBE, update)
            compute, output = decided["compute"], decided["output"]
        given, held = (args, kwargs), self.status
        if compute in ("float16", "bfloat16"):
            kept = FP32_ARGS.get(name, ())
            args, kwargs = _on_grid((args, kwargs), compute)
            if kept:
                args = tuple(given[0][i] if i in kept else a for i, a in enumerate(args))
        kernel = fused[1] if fused is not None else None
        out = self._fused(kernel, compute, args) if kernel else func(*args, **kwargs)
        if output in ("float16", "bfloat16"):
            out = self._round(out, output, op_type in CUBE, FP32_OUTPUTS.get(name, ()))
        elif declared in ("float16", "bfloat16") or not update:
            self._check(out, op_type in CUBE)
        if self.status != held and _nonfinite_given(given):
            # inf/nan the script handed in (a mask's -inf) is no overflow: only a finite
            # input rounded or computed out of range is
            self.status = held
        if isinstance(out, torch.Tensor):
            self._kernels[out] = op_type
        elif isinstance(out, (tuple, list)):
            sums = SUM_OUTPUTS.get(name, ())
            for k, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    self._kernels[t] = "ReduceSum" if k in sums else op_type
        return out

    def _fused(self, op_type: str, compute: str, args):
        """A fused kernel of ops.fused_ops on the call's arguments (already on the compute
        dtype's grid), its inner steps rounded to that dtype as on the device."""
        c = KernelContext(device=True, saturation=self.saturation)
        c.low = compute if compute in ("float16", "bfloat16") else None
        op = REGISTRY[op_type]
        x = args[0].detach().to(torch.float32)
        if op_type == "LayerNorm":
            shape, weight, bias, eps = args[1], args[2], args[3], args[4]
            n = math.prod(shape)
            ones = np.ones(n, np.float32)
            inputs = [_host(x.reshape(-1, n)),
                      _host(weight.float().reshape(n)) if weight is not None else ones,
                      _host(bias.float().reshape(n)) if bias is not None else 0 * ones]
            attrs = {"epsilon": float(eps), "roles": ["y", "mean", "inv"]}
        elif op_type == "RmsNorm":
            shape, weight, eps = args[1], args[2], args[3]
            n = math.prod(shape)
            inputs = [_host(x.reshape(-1, n)), _host(weight.float().reshape(n))
                      if weight is not None else np.ones(n, np.float32)]
            attrs = {"epsilon": float(eps), "roles": ["y", "inv"]}
        else:
            inputs, attrs = [_host(x)], dict(op.attrs, roles=["y"])
            if op_type == "SoftmaxV2":
                attrs["axis"] = args[1]
        c.kernel_inputs = inputs
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            values = op.kernel(inputs, attrs, c)
        self.status |= c.status
        out = [torch.from_numpy(np.ascontiguousarray(v, np.float32)).to(x.device)
               for v in values]
        if op_type == "LayerNorm":
            rows = row_shape(x, args[1])
            # the dtypes torch's CPU kernel gives: mean and rstd in the input's, or in
            # float32 when the weight's dtype is another (its meta kernel says otherwise)
            dtype = args[0].dtype
            stats = dtype if weight is None or weight.dtype == dtype else torch.float32
            return (out[0].reshape(x.shape).to(dtype), out[1].reshape(rows).to(stats),
                    out[2].reshape(rows).to(stats))
        if op_type == "RmsNorm":
            rows = row_shape(x, args[1])
            return out[0].reshape(x.shape).to(args[0].dtype), out[1].reshape(rows)
        half_to_float = op_type == "SoftmaxV2" and len(args) > 2 and args[2]
        return out[0].reshape(x.shape).to(torch.float32 if half_to_float else args[0].dtype)

    def _round(self, out, dtype: str, cube: bool, kept=()):
        """out rounded to dtype's grid (kept: positions of a tuple's outputs left as they
        are), the status word set where a finite value leaves its range."""
        if kept and isinstance(out, (tuple, list)):
            return type(out)(t if i in kept else self._round(t, dtype, cube)
                             for i, t in enumerate(out))

        def one(t):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
                return t
            held = t.detach().to(torch.float32).contiguous()
            value, overflowed = round_result(_host(held), dtype, self.saturation)
            if overflowed:
                self.status |= numerics.STATUS_CUBE_OVERFLOW if cube else \
                    numerics.STATUS_FLOAT_OVERFLOW
            with torch.no_grad():
                # (copy_ takes a CPU tensor into a CUDA one)
                t.copy_(torch.from_numpy(np.ascontiguousarray(value).reshape(held.shape))
                        .to(t.dtype))
            self._dtypes[t] = dtype
            return t
        return _map(one, out)

    def _check(self, out, cube: bool):
        """An fp32 result's overflow (inf/nan it made) sets the status word."""
        def one(t):
            # aten's kernels, not torch.isfinite: a tool that wraps torch's API (msprobe's
            # debugger in the same script) must not see the simulator's own checks as calls
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and \
                    not bool(_ATEN.all.default(_ATEN.isfinite.default(t))):
                self.status |= numerics.STATUS_CUBE_OVERFLOW if cube else \
                    numerics.STATUS_FLOAT_OVERFLOW
            return t
        _map(one, out)


def _decompositions() -> dict:
    from torch._decomp import decomposition_table
    out = {f: decomposition_table[f] for f in (_ATEN.native_layer_norm.default,
                                                _ATEN.native_layer_norm_backward.default,
                                                _ATEN.addmm.default)}
    out[_ATEN._scaled_dot_product_flash_attention_for_cpu.default] = _attention
    out[_ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default] = \
        _attention_backward
    return out


def _attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
               scale=None):
    """The flash kernel's (output, logsumexp) as the ops it fuses compute them: torch's math
    attention (scaled q and k, their product, the mask, softmax, the product with v), each
    a kernel of its own. The log-sum-exp is for the fused backward, which does not run
    while the pass is off (_attention_backward recomputes the weights): zeros of its shape."""
    groups = query.size(1) // key.size(1)
    out, _ = _math_attention(query, key, value, dropout_p, is_causal, attn_mask, scale, groups)
    with torch.utils._python_dispatch._disable_current_modes():
        lse = torch.zeros(query.shape[:3], dtype=torch.float32)
    # the layout the flash kernel gives (N, H, L, E viewed from (N, L, H, E))
    return out.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3), lse


def _math_attention(query, key, value, dropout_p, is_causal, attn_mask, scale, groups):
    """torch's math attention; the mode takes its composite ops apart into their kernels."""
    return _ATEN._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=groups > 1)


def _attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                        *, attn_mask=None, scale=None):
    """The flash kernel's gradients as the unfused ops' backward computes them: the
    attention weights again (the math attention's kernels), then dV = P^T dO, dP = dO V^T,
    softmax's backward and the two products with the scale, each a kernel of its own."""
    groups = query.size(1) // key.size(1)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    _, p = _math_attention(query, key, value, dropout_p, is_causal, attn_mask, scale, groups)
    k, v = (t.repeat_interleave(groups, 1) for t in (key, value)) if groups > 1 \
        else (key, value)
    grad_v = torch.matmul(p.transpose(-2, -1), grad_out)
    grad_p = torch.matmul(grad_out, v.transpose(-2, -1))
    grad_s = _ATEN._softmax_backward_data.default(grad_p, p, -1, p.dtype)
    grad_q = torch.matmul(grad_s, k) * scale
    grad_k = torch.matmul(grad_s.transpose(-2, -1), query) * scale
    if groups > 1:              # each key and value head served `groups` query heads
        grad_k, grad_v = (g.unflatten(1, (key.size(1), groups)).sum(2)
                          for g in (grad_k, grad_v))
    return grad_q, grad_k, grad_v


_DECOMPOSED = _decompositions()


def _nonfinite_given(tree) -> bool:
    """Whether the script's own arguments hold inf or nan (a float, or a float tensor)."""
    for v in tensors_in(tree):
        if v.is_floating_point() and v.numel() and \
                not bool(_ATEN.all.default(_ATEN.isfinite.default(v))):
            return True
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return True
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return False


_ATTENTION_CALLS = frozenset({torch.nn.functional.scaled_dot_product_attention})
# what nn.LSTM, nn.GRU and nn.RNN call for a whole stack of layers
_RECURRENT_CALLS = frozenset({torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu})


def _declared(floats) -> str:
    dtypes = {a.dtype for a in floats}
    for low in _LOW:
        if low in dtypes:
            return str(low).replace("torch.", "")
    return "float32"


def tensors_in(*trees) -> list:
    """The tensors in nested lists, tuples and dicts, in order. (Called for every kernel and
    call: a flat argument tuple, the usual case, costs no recursion.)"""
    out: list = []
    for tree in trees:
        if isinstance(tree, torch.Tensor):
            out.append(tree)
            continue
        items = tree.values() if isinstance(tree, dict) else \
            tree if isinstance(tree, (list, tuple)) else ()
        for x in items:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                _collect(x, out)
    return out


def _collect(v, out: list) -> None:
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                _collect(x, out)
    elif isinstance(v, dict):
        _collect(tuple(v.values()), out)


def _map(fn, value):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        mapped = [_map(fn, v) for v in value]
        return type(value)(mapped) if not hasattr(value, "_fields") else type(value)(*mapped)
    return value


def _on_grid(tree, dtype: str):
    """Float tensors of (args, kwargs) rounded to the grid of dtype, held in their own dtype:
    new tensors (the script's own are never changed)."""
    low = torch.float16 if dtype == "float16" else torch.bfloat16

    def one(v):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() and v.dtype not in _LOW:
                with torch.no_grad():
                    return v.to(low).to(v.dtype)
            return v
        if isinstance(v, (list, tuple)):
            return type(v)(one(x) for x in v)
        if isinstance(v, dict):
            return {k: one(x) for k, x in v.items()}
        return v
    return one(tree)
