"""Where a nan or inf first appears across the ranks of a data-parallel run, when collectives
have spread it to every rank by the time anyone looks.

The ranks' own execution orders cannot be merged by time (a dump has none across processes),
but collectives line them up: the k-th call of a collective (Distributed.all_reduce.k) is one
event on every rank. So each rank's first call with a nan/inf output is placed by how many
collectives the rank had called before it (its epoch). A rank whose first nan/inf is the
output of a collective whose input on that rank was finite received it; a rank whose first
nan/inf is any other call made it (or was fed it). The origin is the rank that made one in
the earliest epoch (several ranks in the same epoch are all named: the dump cannot order
them), and the collective that carried it is the first one after it on the ranks that
received it. Works on every run's index (its nan/inf counts; an msprobe dump's from its
statistics), with or without a golden run.

Replicas must also agree: in data-parallel training every rank holds the same parameters and
the same result of an all-reduce. rank_disagreements compares those across ranks by the
dump's statistics (exactly: replicas compute them from the same bits)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np

COLLECTIVE = "Distributed."


@dataclass
class RankEvent:
    rank: str
    run: str
    op_name: str
    op_type: str
    epoch: int                  # collectives the rank called before it
    received: bool              # a collective's output, its input on this rank finite
    source: str = ""            # the script's line, where the dump says


@dataclass
class RankOrigin:
    step: int
    origin: List[RankEvent]                  # the rank(s) that made it, in the earliest epoch
    received: List[RankEvent]                # ranks that got it through a collective
    others: List[RankEvent] = field(default_factory=list)   # made later elsewhere too
    ranks: int = 0
    # where the analysis cannot see: no rank made it (each received it)
    note: str = ""
    partial_steps: List[int] = field(default_factory=list)   # dumped by some ranks only
    # where replicas hold different values they must hold alike (the first step with any)
    disagree: List["Disagreement"] = field(default_factory=list)
    first_rank: str = ""        # the rank the others are held against

    def to_dict(self) -> dict:
        return asdict(self)


def _nonfinite(table) -> np.ndarray:
    counts = np.zeros(len(table))
    for name in ("nan_count", "pos_inf_count", "neg_inf_count"):
        if name in table:
            counts = counts + np.nan_to_num(np.asarray(table[name], dtype=float))
    return counts > 0


def epochs(table) -> Dict[str, int]:
    """Each call of a rank's step -> how many collectives the rank called before it."""
    out: Dict[str, int] = {}
    epoch = 0
    for name, op_type in zip(table["op_name"].tolist(), table["op_type"].tolist()):
        if name not in out:
            out[name] = epoch
            if op_type.startswith(COLLECTIVE):
                epoch += 1
    return out


def divergence_origin(ws, pairs: list, step: int, judge) -> Optional[dict]:
    """Where a divergence from the reference first appears across ranks: each rank's step
    compared with its own reference (pairs: (run, reference run)) and judged (judge(run,
    reference, step) -> the step's root cause), its first origin placed by its epoch; the
    earliest named, as nan/inf is (a collective's output that diverges while its input on
    that rank matches was received). None when no rank has an origin."""
    found = []
    for run, reference in pairs:
        cause = judge(run, reference, step)
        origin = cause.first_origin if cause is not None else None
        if origin is None:
            continue
        epoch = epochs(ws.index_table(run, step)).get(origin.op_name, 0)
        found.append({"rank": str(run.info.get("rank") or run.label), "run": run.label,
                      "reference": reference.label, "op_name": origin.op_name,
                      "op_type": origin.op_type, "epoch": epoch,
                      "received": origin.op_type.startswith(COLLECTIVE)})
    if not found:
        return None
    made = [f for f in found if not f["received"]] or found
    first = min(f["epoch"] for f in made)
    return {"step": step, "ranks": found, "first": [f for f in made if f["epoch"] == first],
            "compared": len(pairs)}


def first_nonfinite(table) -> Optional[dict]:
    """A rank's first call whose output holds nan/inf, in its step's execution order, with
    its epoch and whether a collective brought it in."""
    bad = _nonfinite(table).tolist()
    types, nonfinite_in, nonfinite_out = {}, set(), set()
    for k, (name, op_type, io) in enumerate(zip(table["op_name"].tolist(),
                                                table["op_type"].tolist(),
                                                table["io"].tolist())):
        types.setdefault(name, op_type)
        if bad[k]:
            (nonfinite_in if io == "input" else nonfinite_out).add(name)
    for name, epoch in epochs(table).items():        # in execution order
        if name in nonfinite_out:
            collective = types[name].startswith(COLLECTIVE)
            return {"op_name": name, "op_type": types[name], "epoch": epoch,
                    "received": collective and name not in nonfinite_in}
    return None


def look_across_ranks(ws, runs: list) -> Optional[RankOrigin]:
    """nonfinite_origin, with the first step's disagreements between replicas
    (rank_disagreements) before it or, with no nan/inf, in any step; None when neither is
    found and every rank dumped the same steps."""
    found = nonfinite_origin(ws, runs)
    common = sorted(set.intersection(*(set(r.complete_steps) for r in runs)))
    if found is not None and found.step >= 0:
        common = [s for s in common if s <= found.step]
    step = _first_disagreement(ws, runs, common)
    if step is not None:
        if found is None:
            found = RankOrigin(-1, [], [], ranks=len(runs))
        found.disagree = rank_disagreements(ws, runs, step)
        found.first_rank = str(runs[0].info.get("rank") or runs[0].label)
    return found


def _first_disagreement(ws, runs: list, steps: List[int]) -> Optional[int]:
    """The first of `steps` in which replicas disagree. Replicas that part stay apart (their
    parameters differ from then on), so the last step says whether any does, and a
    bisection finds the first: a few steps' indexes per rank, not every step's."""
    if not steps or not rank_disagreements(ws, runs, steps[-1], limit=1):
        return None
    lo, hi = 0, len(steps) - 1          # steps[hi] disagrees; find the first that does
    while lo < hi:
        mid = (lo + hi) // 2
        if rank_disagreements(ws, runs, steps[mid], limit=1):
            hi = mid
        else:
            lo = mid + 1
    return steps[lo]


def nonfinite_origin(ws, runs: list) -> Optional[RankOrigin]:
    """The first step every rank dumped in which a rank holds a nan/inf, and where it came
    from (see the module); None when no rank holds one and every rank dumped the same
    steps."""
    common = sorted(set.intersection(*(set(r.complete_steps) for r in runs)))
    partial = sorted(set.union(*(set(r.complete_steps) for r in runs)) - set(common))
    for step in common:
        events = []
        for run in runs:
            found = first_nonfinite(ws.index_table(run, step))
            if found is not None:
                site = ws.call_sites(run, step).get(found["op_name"], {})
                events.append(RankEvent(str(run.info.get("rank") or run.label), run.label,
                                        found["op_name"], found["op_type"], found["epoch"],
                                        found["received"], site.get("source", "")))
        if not events:
            continue
        made = [e for e in events if not e.received]
        received = [e for e in events if e.received]
        if not made:
            return RankOrigin(step, [], received, ranks=len(runs), partial_steps=partial,
                              note="every rank received it through a collective: the rank "
                                   "that made it did not dump that step, or not that call")
        first = min(e.epoch for e in made)
        return RankOrigin(step, [e for e in made if e.epoch == first], received,
                          [e for e in made if e.epoch != first], len(runs),
                          partial_steps=partial)
    return RankOrigin(-1, [], [], ranks=len(runs), partial_steps=partial) if partial else None


def sibling_ranks(ws, run) -> list:
    """The runs that are the ranks of one data-parallel run with `run`, in rank order: the
    ranks of one imported dump, or the runs of one launch (run.json's rank_group, which
    the PyTorch front-end writes under torchrun); [run] alone otherwise."""
    source, group = run.info.get("source"), run.info.get("rank_group")
    if source:
        return [r for r in ws.runs(run.target) if r.info.get("source") == source]
    if not group:
        return [run]
    ranks = [r for r in ws.runs(run.target) if r.info.get("rank_group") == group]
    return sorted(ranks, key=lambda r: (r.info.get("rank_number") is None,
                                        r.info.get("rank_number") or 0, r.label))


# collectives whose output every rank holds the same of (a reduce-scatter's is a shard)
REPLICATED = ("Distributed.all_reduce", "Distributed.broadcast", "Distributed.all_gather",
              "Distributed.all_gather_into_tensor", "Distributed._all_gather_base")
_STATS = ("max", "min", "mean", "l2norm")


@dataclass
class Disagreement:
    step: int
    rank: str                   # the rank that differs from the first rank
    run: str
    tensor: str                 # call:io:index
    what: str                   # "collective output" or "parameter"
    detail: str


def _replicated(table) -> Dict[str, tuple]:
    """What data-parallel ranks must hold alike in a step: every replicated collective's
    outputs, and every parameter a call reads (an input that requires grad and that no
    call of the step made): (call:io:index) -> (kind, statistics)."""
    out: Dict[str, tuple] = {}
    grad = table["requires_grad"].tolist() if "requires_grad" in table else None
    records = zip(table["op_name"].tolist(), table["op_type"].tolist(), table["io"].tolist(),
                  table["index"].tolist(), table["tensor"].tolist(),
                  *(np.asarray(table[c], dtype=float).tolist() for c in _STATS),
                  table["md5"].tolist() if "md5" in table else [""] * len(table))
    for k, (name, op_type, io, index, tensor, hi, lo, mean, norm, md5) in enumerate(records):
        if io == "output" and op_type in REPLICATED:
            kind = "collective output"
        elif io == "output" and op_type == "Variable":     # our front-end's parameters
            kind = "parameter"
        elif io == "input" and grad is not None and grad[k] == "true" and \
                tensor.endswith(f".input.{index}"):
            kind = "parameter"
        else:
            continue
        out[f"{name}:{io}:{index}"] = (kind, (hi, lo, mean, norm, md5))
    return out


def _same(a: tuple, b: tuple) -> bool:
    return all(x == y or (x != x and y != y) for x, y in zip(a, b))


def rank_disagreements(ws, runs: list, step: int, limit: int = 5) -> List[Disagreement]:
    """Where the ranks of a data-parallel step hold different values that they must hold
    alike (a replicated collective's output, a parameter), by the dump's statistics (and
    md5), each rank against the first; at most `limit` per rank. Ranks whose calls differ
    (not replicas) are not compared."""
    base = _replicated(ws.index_table(runs[0], step))
    found: List[Disagreement] = []
    for run in runs[1:]:
        mine = _replicated(ws.index_table(run, step))
        shown = 0
        for key, (kind, stats) in mine.items():
            other = base.get(key)
            if other is None or _same(stats, other[1]):
                continue
            # the first statistic that tells them apart, the norm first, in full
            names = ("max", "min", "mean", "norm", "md5")
            n, a, b = next((names[i], stats[i], other[1][i]) for i in (3, 0, 1, 2, 4)
                           if not _same((stats[i],), (other[1][i],)))
            diff = f"{n} {a!r} against {b!r}"
            found.append(Disagreement(step, str(run.info.get("rank") or run.label), run.label,
                                      key, kind, diff))
            shown += 1
            if shown >= limit:
                break
    return found
