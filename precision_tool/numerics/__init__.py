"""Conversions that both the runtime and the analysis need, a module per concern: the
float16/bfloat16 grids (grid: rounding, saturation, extremes), the AI Core float-status bits
(status) and the NCHW <-> NC1HWC0 data format (formats). A leaf package (numpy and
ml_dtypes only), so that the simulated NPU and the analysis of its dumps use one definition
of each conversion; its names are all here."""
from .formats import C0, five_hd_shape, five_hd_to_nchw, logical_view, nchw_to_5hd
from .grid import BF16_MAX, FP16_MAX, FP32_MAX, max_of, quantize, saturate
from .status import (STATUS_BITS, STATUS_CAST_OVERFLOW, STATUS_CUBE_OVERFLOW,
                     STATUS_FLOAT_OVERFLOW, STATUS_FLOAT_TO_INT, STATUS_INT_DIV_ZERO,
                     STATUS_INT_OVERFLOW, decode_status)

__all__ = ["C0", "five_hd_shape", "five_hd_to_nchw", "logical_view", "nchw_to_5hd", "BF16_MAX",
           "FP16_MAX", "FP32_MAX", "max_of", "quantize", "saturate", "STATUS_BITS",
           "STATUS_CAST_OVERFLOW", "STATUS_CUBE_OVERFLOW", "STATUS_FLOAT_OVERFLOW",
           "STATUS_FLOAT_TO_INT", "STATUS_INT_DIV_ZERO", "STATUS_INT_OVERFLOW", "decode_status"]
