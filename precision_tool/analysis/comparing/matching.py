"""Which call of the reference dump a call of the compared dump stands for, where the two
dumps name calls by API and call index (msprobe's: Functional.linear.3.forward) and their
call lists differ: another framework version, a changed script, a call one side's hooks saw
and the other's did not. One extra call shifts every later index of its API, so names alone
would pair the wrong tensors, silently where shapes agree.

The two steps' calls are aligned in execution order on what a call is (its API, its
direction, its tensors' shapes), longest matching blocks first (difflib's matcher): every
call is paired with the reference's call in the same place of the same kind, or with none,
and the unpaired on either side are listed by the compare, never dropped. Identical call
lists (the common case) pair by name without aligning."""
from __future__ import annotations

import difflib
from typing import Dict, List, Tuple

from ...dump.formats.msprobe import call_type


def _calls(table) -> Tuple[List[str], Dict[str, tuple]]:
    """The calls of a step's index in execution order, and each one's signature."""
    names = table["op_name"].tolist()
    io = table["io"].tolist()
    shapes = table["shape"].tolist()
    order: List[str] = []
    sig: Dict[str, list] = {}
    for name, kind, shape in zip(names, io, shapes):
        if name not in sig:
            order.append(name)
            direction = "backward" if ".backward" in name else "forward"
            sig[name] = [call_type(name), direction, [], []]
        sig[name][2 if kind == "input" else 3].append(shape)
    return order, {n: (s[0], s[1], tuple(s[2]), tuple(s[3])) for n, s in sig.items()}


def align_calls(npu, golden) -> Dict[str, str]:
    """compared call -> reference call, for every call that has a counterpart (see the
    module); a call absent from the result has none."""
    left, left_sig = _calls(npu)
    right, right_sig = _calls(golden)
    if left == right:
        return {name: name for name in left}
    matcher = difflib.SequenceMatcher(None, [left_sig[n] for n in left],
                                      [right_sig[n] for n in right], autojunk=False)
    pairs: Dict[str, str] = {}
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            pairs[left[a + k]] = right[b + k]
    # a call whose shapes changed (a new batch size) but whose name the other side has at
    # the same place still pairs by name
    taken = set(pairs.values())
    right_set = set(right)
    for name in left:
        if name not in pairs and name in right_set and name not in taken and \
                left_sig[name][:2] == right_sig[name][:2]:
            pairs[name] = name
            taken.add(name)
    return pairs
