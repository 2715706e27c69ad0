"""The AI Core float-status word: its bits (aclrtFloatOverflowMode / NPUGetFloatStatus) and
their names."""
from __future__ import annotations

from typing import List

STATUS_INT_OVERFLOW = 0x8          # integer arithmetic wrapped around
STATUS_INT_DIV_ZERO = 0x10         # integer division by zero (no op of our set produces it)
STATUS_FLOAT_OVERFLOW = 0x20       # a float result left the range of its dtype, or became inf/nan
STATUS_FLOAT_TO_INT = 0x80         # a float to integer conversion was out of range
STATUS_CAST_OVERFLOW = 0x100       # an fp32 -> fp16/bf16 conversion overflowed
STATUS_CUBE_OVERFLOW = 0x400       # the cube unit's fp32 accumulator overflowed

STATUS_BITS = {
    STATUS_INT_OVERFLOW: "integer overflow",
    STATUS_INT_DIV_ZERO: "integer divide by zero",
    STATUS_FLOAT_OVERFLOW: "floating-point overflow",
    STATUS_FLOAT_TO_INT: "float to integer conversion overflow",
    STATUS_CAST_OVERFLOW: "fp32 to fp16/bf16 conversion overflow",
    STATUS_CUBE_OVERFLOW: "cube accumulation overflow",
}


def decode_status(status: int) -> List[str]:
    """The status word as words, lowest bit first; unknown bits are shown in hex."""
    words, rest = [], int(status)
    for bit, word in STATUS_BITS.items():
        if rest & bit:
            words.append(word)
            rest &= ~bit
    if rest:
        words.append(f"unknown bits 0x{rest:x}")
    return words
