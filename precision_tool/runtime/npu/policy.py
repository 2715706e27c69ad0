"""Precision policies: which dtype each op of a compiled graph computes in.

`precision_mode` as on Ascend, and MindSpore's `amp_level` O0-O3 on the same mechanism:

- force_fp32: every float op in fp32.
- must_keep_origin_dtype (O0): every op in the dtype the graph declares.
- allow_fp32_to_fp16: fp32 cube ops read fp16 and write fp32 (fp32 accumulation kept);
  vector ops, and cube ops declared fp16 or bf16, keep their dtype.
- force_fp16 (O3): every float op in fp16.
- allow_mix_precision / allow_mix_precision_bf16: white-list ops in fp16 (bf16), black-list
  ops in fp32, gray-list ops follow their inputs: low precision when every float input that
  is data (not a variable or constant) is low precision, fp32 otherwise. Both lower float32
  ops: a white- or gray-list op declared in the other low dtype (bf16 under the fp16 mode)
  keeps it.
- O1: white-list ops in fp16, every other op in fp32.
- O2: every float op in fp16 except the norms (BatchNorm, LayerNorm, RmsNorm).

In every mode the ops that update state (optimizers, moving averages, the loss scale) run
in fp32 on fp32 variables: the master weights stay fp32. So do ops whose node carries the
attribute `keep_dtype` (the loss scaling's multiply, unscale and their casts: MindSpore and
the TF adapter scale the fp32 loss in fp32; overflows then happen where they do on the
device, in the low-precision backward). A modify_mixlist JSON edits the
lists: {"black-list": {"to-add": [...], "to-remove": [...]}, "white-list": {...},
"gray-list": {...}}.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional

from ...errors import PrecisionToolError
from ...fileio import load_json

PRECISION_MODES = ("force_fp32", "allow_fp32_to_fp16", "force_fp16", "must_keep_origin_dtype",
                   "allow_mix_precision", "allow_mix_precision_bf16")
AMP_LEVELS = ("O0", "O1", "O2", "O3")

# the modes that read a modify_mixlist
MIXLIST_MODES = frozenset({"allow_mix_precision", "allow_mix_precision_bf16", "O1"})
# under a mode that reads none, the mode whose black-list can keep an op type in fp32 (what
# `ac` advises and `fix` replays: one table for both)
MIXLIST_FOR = {"force_fp16": "allow_mix_precision", "allow_fp32_to_fp16": "allow_mix_precision",
               "must_keep_origin_dtype": "allow_mix_precision", "O2": "O1", "O3": "O1"}
DEFAULT_MODE = "allow_fp32_to_fp16"

WHITE = frozenset({"MatMul", "BatchMatMul", "Conv2D", "Conv2DBackpropInput",
                   "Conv2DBackpropFilter", "MatMulV2", "BatchMatMulV2", "Conv2DBatchNorm"})
BLACK = frozenset({"Exp", "Log", "Pow", "Sqrt", "Rsqrt", "SqrtGrad", "RsqrtGrad", "ReduceSum",
                   "ReduceMean", "LogSoftmax", "SparseSoftmaxCrossEntropyWithLogits",
                   "BatchNorm", "BatchNormGrad"})
LOW = ("float16", "bfloat16")
NORM_FAMILY = frozenset({"BatchNorm", "BatchNormGrad", "LayerNorm", "RmsNorm"})
# state updates and status ops: fixed dtypes whatever the mode
FIXED = frozenset({"Placeholder", "Variable", "Const", "NoOp", "Cast", "OneHot", "TransData",
                   "NPUGetFloatStatus", "NPUClearFloatStatus"})


class PolicyError(PrecisionToolError, ValueError):
    """A precision mode, amp level or modify_mixlist that cannot be used."""


@dataclass(frozen=True)
class Policy:
    mode: str                      # a precision mode or "O0".."O3"
    low: str                       # "float16" or "bfloat16"
    white: FrozenSet[str]
    black: FrozenSet[str]

    def decide(self, op_type: str, declared: str, input_votes, is_cube: bool,
               is_update: bool) -> Dict[str, str]:
        """{'compute': dtype, 'output': dtype} for a float op. `input_votes`: the dtypes of its
        computed (non-variable, non-constant) float inputs."""
        fp32 = "float32"
        if is_update:
            return {"compute": declared, "output": declared}
        mode = self.mode
        if mode in ("must_keep_origin_dtype", "O0"):
            dt = declared
        elif mode == "force_fp32":
            dt = fp32
        elif mode == "allow_fp32_to_fp16":
            if is_cube and declared == fp32:
                return {"compute": "float16", "output": fp32}
            dt = declared
        elif mode in ("force_fp16", "O3"):
            dt = self.low
        elif mode == "O2":
            dt = fp32 if op_type in NORM_FAMILY else self.low
        elif mode == "O1":
            dt = self.low if op_type in self.white else fp32
        else:  # allow_mix_precision(_bf16)
            if op_type in self.black:
                dt = fp32
            elif declared in LOW and declared != self.low:
                # the mode lowers float32 ops: one the graph (a script's cast) declares in
                # the other low dtype keeps it, never moved from bf16 to fp16 or back
                dt = declared
            elif op_type in self.white:
                dt = self.low
            else:
                votes = list(input_votes)
                dt = self.low if votes and all(v == self.low for v in votes) else fp32
        return {"compute": dt, "output": dt}


def make_policy(precision_mode: str, amp_level: Optional[str], modify_mixlist) -> Policy:
    if amp_level is not None:
        if amp_level not in AMP_LEVELS:
            raise PolicyError(f"amp_level must be one of {', '.join(AMP_LEVELS)}, got {amp_level!r}")
        mode = amp_level
    else:
        if precision_mode not in PRECISION_MODES:
            raise PolicyError(f"precision_mode must be one of {', '.join(PRECISION_MODES)}, "
                              f"got {precision_mode!r}")
        mode = precision_mode
    low = "bfloat16" if mode == "allow_mix_precision_bf16" else "float16"
    white, black = set(WHITE), set(BLACK)
    if modify_mixlist is not None:
        if mode not in MIXLIST_MODES:
            raise PolicyError(f"modify_mixlist only applies to allow_mix_precision modes, "
                              f"not to {mode}")
        white, black = _edit_lists(load_mixlist(modify_mixlist), white, black)
    return Policy(mode, low, frozenset(white), frozenset(black))


def load_mixlist(spec) -> dict:
    """A modify_mixlist given as a dict or as the path of its JSON file, as a dict."""
    if isinstance(spec, dict):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise PolicyError(f"modify_mixlist must be a dict or a JSON file path, got {spec!r}")
    return load_json(spec, PolicyError, "modify_mixlist")


def _edit_lists(edits: dict, white: set, black: set):
    from ...ops import REGISTRY
    if not isinstance(edits, dict):
        raise PolicyError("modify_mixlist must be a JSON object")
    lists = {"white-list": white, "black-list": black, "gray-list": set()}
    for key, change in edits.items():
        if key not in lists or not isinstance(change, dict) or \
                not set(change) <= {"to-add", "to-remove"}:
            raise PolicyError(f"modify_mixlist: expected {{\"white-list\"|\"black-list\"|"
                              f"\"gray-list\": {{\"to-add\": [...], \"to-remove\": [...]}}}}, "
                              f"got {key!r}: {change!r}")
        for verb, ops in change.items():
            if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
                raise PolicyError(f"modify_mixlist: {key}.{verb} must be a list of op types")
            unknown = [o for o in ops if o not in REGISTRY]
            if unknown:
                raise PolicyError(f"modify_mixlist: unknown op types {unknown} in {key}.{verb}")
            for op in ops:
                if verb == "to-add":
                    for other in (white, black):  # an op is on one list at a time
                        other.discard(op)
                    lists[key].add(op)
                else:
                    lists[key].discard(op)
    return white, black


def mode_of(config: dict) -> str:
    """The mode of a configuration (SessionConfig fields, a run's run.json): its amp level
    when it has one, else its precision mode."""
    return config.get("amp_level") or config.get("precision_mode") or DEFAULT_MODE


def mixlist_mode(mode: str) -> str:
    """The mode under which a black-list keeps an op type in fp32: the mode itself when it
    reads a mixlist, else the nearest that does."""
    return mode if mode in MIXLIST_MODES else MIXLIST_FOR.get(mode, "allow_mix_precision")


def all_fp32_mode(mode: str) -> str:
    """The mode that computes every op in fp32, in the family of `mode` (an amp level's O0,
    otherwise force_fp32)."""
    return "O0" if mode.startswith("O") else "force_fp32"

