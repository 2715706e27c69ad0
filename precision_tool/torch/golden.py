"""The golden of a script that asks for low precision: every API call computed in float32.

A script that casts (`.half()`, `.bfloat16()`, `.to(torch.float16)`), creates low-precision
tensors (`dtype=torch.bfloat16`) or runs under `torch.autocast` would make its golden a
low-precision run, and then nothing could say what the NPU's low precision lost. The
debugger's function mode hands every API call here first: a request for fp16/bf16 becomes
one for float32 (`.half()` and `.bfloat16()` become a float32 copy), and a call made while
autocast is on runs with autocast off. It is done per API call, not per kernel: a dispatch
mode on every aten op cost a third of a golden step, and the calls are where a script asks.
A tensor made low before the debugger started (a model halved before `start`) is not
changed; torch-run starts it before the script runs. A script that asks for nothing of the
kind computes exactly as written: no argument is changed."""
from __future__ import annotations

import contextlib
from typing import Set

import torch

_LOW = (torch.float16, torch.bfloat16)
_CASTS = frozenset({"half", "bfloat16"})
_DEVICES = ("cpu", "cuda")


def _autocast_on() -> tuple:
    """The device types autocast is on for now."""
    return tuple(d for d in _DEVICES if torch.is_autocast_enabled(d))


class GoldenFP32:
    """lifted: what asked for low precision and ran in float32 instead (API names, and
    "autocast"); empty for a script that never asks."""

    def __init__(self):
        self.lifted: Set[str] = set()

    def call(self, func, args, kwargs):
        """func(*args, **kwargs), with its requests for fp16/bf16 made float32."""
        name = getattr(func, "__name__", "")
        if name in _CASTS and args and isinstance(args[0], torch.Tensor) and \
                args[0].is_floating_point():
            self.lifted.add(f"Tensor.{name}")
            return args[0].to(torch.float32)
        if kwargs.get("dtype") in _LOW:
            kwargs = dict(kwargs, dtype=torch.float32)
            self.lifted.add(name)
        if any(a in _LOW for a in args if isinstance(a, torch.dtype)):
            args = tuple(torch.float32 if isinstance(a, torch.dtype) and a in _LOW else a
                         for a in args)
            self.lifted.add(name)
        on = _autocast_on()
        if not on:
            return func(*args, **kwargs)
        self.lifted.add("autocast")
        with contextlib.ExitStack() as stack:       # autocast off for the call
            for device in on:
                stack.enter_context(torch.autocast(device, enabled=False))
            return func(*args, **kwargs)
