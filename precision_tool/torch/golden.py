"""The golden of a script that asks for low precision: every API call computed in float32.

A script that casts (`.half()`, `.bfloat16()`, `.to(torch.float16)`), creates low-precision
tensors (`dtype=torch.bfloat16`) or runs under `torch.autocast` would make its golden a
low-precision run, and then nothing could say what the NPU's low precision lost. The
debugger's function mode hands every API call here first: a request for fp16/bf16 becomes
one for float32 (`.half()` and `.bfloat16()` become a float32 copy), and a call made while
autocast is on runs with autocast off; an autocast the script enters once the debugger has
started is entered disabled (AutocastOff). It is done per API call, not per kernel: a dispatch
mode on every aten op cost a third of a golden step, and the calls are where a script asks.
A tensor made low before the debugger started (a model halved before `start`) is not
changed; torch-run starts it before the script runs. A script that asks for nothing of the
kind computes exactly as written: no argument is changed.

GoldenFP64 (golden_dtype="float64", on request) computes every call in float64: each float
argument of another dtype is handed in as a float64 copy (differentiable: gradients flow
back to the script's tensors in their own dtype), and a request for float16, bfloat16 or
float32 (.half(), .float(), dtype=) becomes one for float64. What the script creates is
created as written (the same random draws as the NPU run's, which a float64 default dtype
would not give); its parameters keep their dtype, and a call in place (an update, an
initialiser) runs as written, in its tensor's dtype.
A golden whose every computation is float64 says what float32 itself loses."""
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


class AutocastOff:
    """While installed, an autocast context the script enters is entered disabled (its
    object left as it was): the golden's calls then never see autocast on, and neither does
    what reads its state later. Lifting it per call alone is not enough: activation
    checkpointing saves the autocast state when the forward runs and recomputes the forward
    inside the backward under it, out of the debugger's sight (torch hands the backward's
    inner calls to no function mode), in bfloat16 where the forward had computed float32;
    torch refuses the mismatch. lifted gets "autocast" when one is entered."""

    def __init__(self, lifted: Set[str]):
        cls = self.cls = torch.amp.autocast_mode.autocast
        enter0 = self.enter0 = cls.__enter__

        def enter(ctx):
            asked = getattr(ctx, "_enabled", False)
            if not asked:
                return enter0(ctx)
            lifted.add("autocast")
            ctx._enabled = False
            try:
                return enter0(ctx)
            finally:
                ctx._enabled = asked        # a decorator's context, re-entered later
        cls.__enter__ = enter

    def remove(self) -> None:
        self.cls.__enter__ = self.enter0


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


_BELOW_64 = (torch.float16, torch.bfloat16, torch.float32)
_CASTS_64 = frozenset({"half", "bfloat16", "float"})


class GoldenFP64:
    """Every API call computed in float64 (see the module); lifted as GoldenFP32's."""

    def __init__(self):
        self.lifted: Set[str] = set()

    def call(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        if name in _UNTOUCHED or (name.startswith("_") and not name.endswith("__")):
            # an attribute's access (a Parameter's .data, its grad) and torch's own calls
            # (a Parameter's _make_subclass) are no computation: as they are
            return func(*args, **kwargs)
        if name in _CASTS_64 and args and isinstance(args[0], torch.Tensor) and \
                args[0].is_floating_point():
            return args[0].to(torch.float64)
        if kwargs.get("dtype") in _BELOW_64:
            kwargs = dict(kwargs, dtype=torch.float64)
        if name in _ALIASING:         # tensors as they are; a dtype asked for is float64
            args = tuple(a if isinstance(a, torch.Tensor) else _wide(a) for a in args)
            kwargs = {k: v if isinstance(v, torch.Tensor) else _wide(v)
                      for k, v in kwargs.items()}
        elif not _writes_first(name):
            # (a call in place writes the script's own tensor, whichever argument names it
            # (an initialiser's tensor=): as it is, in that tensor's dtype, as written)
            args = tuple(_wide(a) for a in args)
            kwargs = {k: v if k == "out" else _wide(v) for k, v in kwargs.items()}
        on = _autocast_on()
        if not on:
            return func(*args, **kwargs)
        self.lifted.add("autocast")
        with contextlib.ExitStack() as stack:
            for device in on:
                stack.enter_context(torch.autocast(device, enabled=False))
            return func(*args, **kwargs)


# calls whose result shares the script's tensor (a view): computed as they are, so that a
# write through the view still reaches the tensor; what reads them next is widened then
_ALIASING = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "T", "mT",
    "__getitem__", "expand", "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten",
    "narrow", "select", "split", "chunk", "unbind", "detach", "contiguous", "as_strided",
    "movedim", "swapaxes", "diagonal", "unfold", "real", "imag", "to", "type", "clone",
    "__setitem__", "data", "requires_grad_", "retain_grad", "register_hook", "backward",
    "size", "dim", "numel", "item", "tolist", "numpy", "cpu", "cuda",
    # what the script creates after a tensor (optimizer state) keeps that tensor's dtype
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})
_UNTOUCHED = frozenset({"__get__", "__set__", "__delete__", "__setstate__", "__reduce_ex__",
                        "__deepcopy__", "__repr__", "__format__", "__bool__", "__len__",
                        "__iter__", "__hash__", "__contains__"})
_IN_PLACE = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv",
                                               "mod", "pow", "matmul", "and", "or", "xor"))


def _writes_first(name: str) -> bool:
    return name in _IN_PLACE or (name.endswith("_") and not name.endswith("__"))


def _wide(v):
    """A float tensor (or a list of them) as float64; the dtype float64 for a lower one."""
    if isinstance(v, torch.Tensor):
        return v.to(torch.float64) if v.is_floating_point() and v.dtype != torch.float64 \
            else v
    if isinstance(v, torch.dtype):
        return torch.float64 if v in _BELOW_64 else v
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return type(v)(_wide(x) for x in v)
    return v
