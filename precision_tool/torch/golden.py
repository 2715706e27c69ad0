"""The golden of a script that asks for low precision: every kernel computed in float32.

A script that casts (`.half()`, `.bfloat16()`, `.to(torch.float16)`), creates low-precision
tensors (`dtype=torch.bfloat16`) or runs under `torch.autocast` would make its golden a
low-precision run, and then nothing could say what the NPU's low precision lost. Under this
dispatch mode the casts still run, but to float32: autocast's own casts are `_to_copy`
kernels too, so they are caught the same way. A low-precision tensor made before the mode
was entered (a model halved before `start`) is read as float32 by every kernel but an
in-place one, which writes into it as it is. A script that asks for nothing of the kind
computes exactly as written: the mode changes no argument then."""
from __future__ import annotations

from typing import Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .simulate import packet_name

_LOW = (torch.float16, torch.bfloat16)


class GoldenFP32(TorchDispatchMode):
    """lifted: the aten ops (their names) that asked for float16/bfloat16 and computed in
    float32 instead; empty for a script that never asks."""

    def __init__(self):
        super().__init__()
        self.lifted: Set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        asked = False
        if kwargs.get("dtype") in _LOW:
            kwargs = dict(kwargs, dtype=torch.float32)
            asked = True
        # an in-place kernel writes into its first argument: that one stays as it is
        keep_first = packet_name(func).endswith("_") or "out" in kwargs
        lifted_args = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.dtype in _LOW and not (i == 0 and keep_first):
                a, asked = a.to(torch.float32), True
            elif isinstance(a, torch.dtype) and a in _LOW:
                a, asked = torch.float32, True
            elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) and
                                                      x.dtype in _LOW for x in a):
                a, asked = type(a)(x.to(torch.float32) if isinstance(x, torch.Tensor) and
                                   x.dtype in _LOW else x for x in a), True
            lifted_args.append(a)
        if asked:
            self.lifted.add(f"aten.{packet_name(func)}")
        return func(*lifted_args, **kwargs)
