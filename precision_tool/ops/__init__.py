"""The ops layer: one registry of op types, and snake_case builders that add ops to the
default graph (`pt.ops.matmul`, `pt.ops.relu`, ...)."""
from ..graph import Tensor, get_default_graph
from . import array_ops, fused_ops, math_ops, nn_ops, state_ops
from .array_ops import (cast, concat, constant, gather, identity, one_hot, reshape, slice_,
                        transpose)
from .math_ops import (add, add_n, batch_matmul, bias_add, div, divide, equal, exp, gelu,
                       greater, greater_equal, is_nan, less, less_equal, log, logical_and,
                       logical_not, logical_or, matmul, maximum, minimum,
                       mul, multiply, neg, negative, not_equal, ones_like, pow_, reduce_max,
                       reduce_mean, reduce_sum, relu, rsqrt, select, sigmoid, sqrt, square, sub,
                       subtract, tanh, where, zeros_like)
from .nn_ops import (avg_pool, batch_norm, conv2d, dropout, log_softmax, max_pool, softmax,
                     sparse_softmax_cross_entropy_with_logits)
from .registry import REGISTRY, GradContext, KernelContext, OpDef, get, make, validate_node
from .state_ops import no_op, placeholder, variable

pow = pow_  # noqa: A001  (pt.ops.pow, as users spell it)
slice = slice_  # noqa: A001


def _install_operators():
    """Python operators on tensors, as in TF: x + y, x * 2, a @ b, -x, x ** 2."""
    def rev(f):
        return lambda self, other: f(math_ops.lift(other, self), self)
    Tensor.__add__ = lambda self, other: add(self, other)
    Tensor.__radd__ = rev(add)
    Tensor.__sub__ = lambda self, other: sub(self, other)
    Tensor.__rsub__ = rev(sub)
    Tensor.__mul__ = lambda self, other: mul(self, other)
    Tensor.__rmul__ = rev(mul)
    Tensor.__truediv__ = lambda self, other: div(self, other)
    Tensor.__rtruediv__ = rev(div)
    Tensor.__pow__ = lambda self, other: pow_(self, other)
    Tensor.__matmul__ = lambda self, other: matmul(self, other)
    Tensor.__neg__ = lambda self: neg(self)


_install_operators()
