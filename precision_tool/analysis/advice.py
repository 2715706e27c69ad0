"""What to try next (ac's "Next" panel): each line an action the tool can check afterwards (a
configuration to train or replay with, then `ac -c` again, or a command of its own).

The advice follows the finding and what the run can take: a modify_mixlist black-list only
under the precision modes that read one (allow_mix_precision, its bf16 variant, amp O1) and
for ops a policy places (not a Cast the compiler inserted, not an optimizer update, which
computes in its variable's dtype whatever the mode); elsewhere the precision_mode that keeps
the op in fp32. A loss scale is advised with a value worked out from the gradients' range.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from .. import numerics
from ..dump.layout import format_steps
from ..runtime.npu.policy import MIXLIST_MODES, mixlist_mode
from .diagnosis.scale_history import LossScaleHistory, calibration, is_backward
from .replays.remedy import NO_HELP, VERIFIED, Change, describe_all

# steps after a skipped update, not judged (autocheck's key of unseen_steps for them): said
# apart, not as steps to dump again
AFTER_SKIPPED_UPDATE = "diverging after an update the loss scale skipped and the golden took"
# steps whose runs took different paths (comparing.result.first_parting): shapes differ
# after a decision low precision flipped
PARTED = "the runs take different paths, listed under the steps looked at"


def keep_in_fp32(op: dict, mode: str) -> str:
    """How to keep an op's numbers out of fp16 under this mode, as one imperative clause
    (callers join it into their sentence): a mixlist of the op types a policy placed where
    the mode reads one, else the mode that does; for a Cast the compiler inserted, the
    value it casts (data fed in, a constant) or its producer; for an update, its variable."""
    if op.get("inserted"):
        source = op.get("source") or {}
        peak = source.get("peak")
        reach = f" (it reaches {peak:.6g}; fp16 holds magnitudes from about 6e-8 to 65504)" \
            if peak is not None else ""
        if source.get("type") == "Placeholder":
            return (f"normalise or scale what is fed to {source['name']}{reach}, or keep the ops "
                    f"that read it in fp32: the compiler inserted {op['op_name']} to hand it to "
                    f"an fp16 op")
        if source.get("type") == "Const":
            names = op.get("reader_ops") or []
            which = f" ({', '.join(names[:3])}{' and more' if len(names) > 3 else ''})" \
                if names else ""
            return (f"give the constant {source['name']} a value fp16 holds{reach}, or keep the "
                    f"ops that read it{which} in fp32: the compiler inserted {op['op_name']} to "
                    f"hand it to an fp16 op")
        if op.get("readers"):             # the Cast goes when what reads it stays in fp32
            return (keep_in_fp32({"op_name": op["op_name"], "policy_types": op["readers"]}, mode)
                    + f" (the compiler inserted {op['op_name']} to hand its input, fp32, to "
                      f"them in fp16: no list moves the Cast itself)")
        return (f"keep the producer of {op['op_name']} in fp32 (the compiler inserted that Cast: "
                f"no list moves it), or run under precision_mode force_fp32 to confirm")
    if op.get("api_call"):          # a script's call: kept in fp32 by its API's name
        api = op.get("op_type", "")
        if op.get("update"):        # in place: it computes in its tensor's dtype, as asked
            return (f"keep the tensor {api} writes in float32 in the script (a parameter or "
                    f"an optimizer's state: fp32 master weights, the model in float32 and its "
                    f"compute cast down by autocast): a call in place computes in its "
                    f"tensor's dtype, which --keep-fp32 does not change")
        if op.get("imported"):      # a device's dump: the fix is in the script
            return (f"keep {api} in fp32 in the script (its inputs .float(), or outside "
                    f"autocast), and see the effect on the simulated NPU first: torch-run "
                    f"--keep-fp32 {api}")
        return (f"keep {api} in fp32: torch-run --keep-fp32 {api} "
                f"(PrecisionDebugger(keep_fp32=[\"{api}\"]))")
    if op.get("update"):
        return (f"declare the variable {op['op_name']} updates (and its optimizer slots) float32: "
                f"an update computes in its variable's dtype under every mode")
    dtype = op.get("compute_dtype") or ""
    if dtype in ("float32", "float64") or mode in ("force_fp32", "O0"):
        # the mode computes it in fp32 already: a list that keeps it there changes nothing
        return (f"change its algorithm rather than its precision ({op['op_name']} already "
                f"computes in {dtype or 'fp32'} under {mode}: no precision setting raises it)")
    kinds = op.get("policy_types") or [op.get("op_type", "")]
    listed = ", ".join(f'"{k}"' for k in kinds)
    names = ", ".join(kinds)
    if mode in MIXLIST_MODES:
        return (f'keep {names} in fp32: modify_mixlist {{"black-list": {{"to-add": [{listed}]}}}} '
                f"(SessionConfig(modify_mixlist=...) or config/modify_mixlist.json)")
    other = mixlist_mode(mode)
    via = "amp_level" if other.startswith("O") else "precision_mode"
    return (f"keep {names} in fp32: {mode} takes no mixlist, so train with {via} {other} with "
            f'modify_mixlist {{"black-list": {{"to-add": [{listed}]}}}}, or force_fp32 to '
            f"confirm the op is the cause")


def fp32_changes(op: dict, mode: str) -> Tuple[Change, ...]:
    """The configuration change keep_in_fp32 advises for the op, to replay it with: its
    policy's op types in fp32 (through the mode that reads a mixlist, as configure does);
    for an inserted Cast, the types that read it; none for an update, an op the mode keeps
    in fp32 already, or a Cast with no reader a policy placed."""
    if op.get("inserted"):
        readers = op.get("readers") or []
        return tuple(Change("fp32", t) for t in readers)
    if op.get("api_call"):          # no bundle to replay: fix reruns the script instead
        return ()
    dtype = op.get("compute_dtype") or ""
    if op.get("update") or dtype in ("float32", "float64") or mode in ("force_fp32", "O0"):
        return ()
    return tuple(Change("fp32", t) for t in (op.get("policy_types") or [op.get("op_type", "")]) if t)


class Options:
    """The remedies an advice line offers, each tagged with what a replay of the step said of
    it (AutoCheck.remedies): verified first, then those not replayed, and those a replay shows
    do not help last, never leading. `asked` collects every configuration change offered:
    what auto_check replays."""

    def __init__(self, r):
        self.step = r.step
        self.front_end = getattr(r, "front_end", "")     # a PyTorch script's: GradScaler
        self.said = {d["changes"]: d for d in (getattr(r, "remedies", None) or [])}
        self.asked: List[Tuple[Change, ...]] = []

    def tag(self, text: str, changes: Sequence[Change] = ()) -> Tuple[int, str]:
        changes = tuple(changes)
        if changes and changes not in self.asked:
            self.asked.append(changes)
        d = self.said.get(describe_all(changes)) if changes else None
        if d is None:
            return 1, text + " (not verified)"
        if d["verdict"] == VERIFIED:
            return 0, text + f" (verified: a replay of step {self.step} with it matches the golden)"
        return 2, text + f" ({NO_HELP}: a replay of step {self.step} with it {d['evidence']})"

    def either(self, *options: Tuple[int, str]) -> str:
        """The options joined with "or", the best first (stable within a rank)."""
        ranked = sorted(range(len(options)), key=lambda i: (options[i][0], i))
        return ", or ".join(options[i][1] for i in ranked)

    def keep(self, op: dict, mode: str) -> Tuple[int, str]:
        return self.tag(keep_in_fp32(op, mode), fp32_changes(op, mode))

    def only(self, option: Tuple[int, str]) -> str:
        """A line's one option as its sentence: one a replay refutes is said as refuted, not
        offered as the thing to do."""
        rank, text = option
        return f"Not this, a replay shows: {text}" if rank == 2 else _capital(text)


def _dynamic_scale(opts: Options, start: str) -> str:
    """A dynamic loss scale starting at `start`, as the run's front-end spells it."""
    return f"torch.amp.GradScaler(init_scale={start})" if opts.front_end == "pytorch" else \
        f"DynamicLossScaleManager(init_loss_scale={start})"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def suggested_scale(current: float, peak: Optional[float]) -> Optional[float]:
    """A static loss scale that lifts the smallest gradients while the largest (`peak`, at the
    current scale) stays under fp16's maximum with a factor of 2 to spare: a power of two."""
    if peak is None or not peak > 0 or not math.isfinite(peak):
        return None
    room = numerics.FP16_MAX / (2 * peak)
    if room < 2:
        return None
    return current * 2.0 ** math.floor(math.log2(room))


def advise(r, options: Optional[Options] = None) -> List[str]:
    """The advice lines for an AutoCheck `r` (its precision_mode: the run's typed
    configuration's, Run.config); `options` collects the configuration changes they offer
    (Options.asked)."""
    mode = r.precision_mode
    opts = options if options is not None else Options(r)
    lines: List[str] = []
    gap = r.coverage
    parted = {x["step"]: x["parted"] for x in r.steps if x.get("parted")}
    apart = sorted(set(r.unseen_steps.get(PARTED, ())) | ({r.step} & set(parted)))
    if apart:
        lines.append(_parted_text(apart, parted))
    if gap is not None and not gap.complete and r.step not in parted:
        # calls one side made and the other did not: no file to restore
        different = gap.tensors and set(gap.missing) <= {
            "of calls the reference did not make",
            "reference op(s) with no counterpart in the compared graph"}
        lines.append((f"{gap.not_compared} of {gap.tensors} tensors could not be compared "
                      f"({', '.join(gap.missing)})" if gap.tensors else
                      f"Nothing could be compared ({gap.text()})") +
                     (": the two runs did not make the same calls (a changed script, another "
                      "framework version?); those are not compared, what follows covers the "
                      "rest." if different else
                      ": dump the step again (or restore the files) and run ac -c again; what "
                      "follows covers what was compared."))
    unseen = {why: steps for why, steps in r.unseen_steps.items()
              if why not in (AFTER_SKIPPED_UPDATE, PARTED)}
    if unseen:
        lines.append("Not every dumped step could be compared (" + "; ".join(
            f"{why}: {format_steps(steps)}" for why, steps in unseen.items()) +
            "): what follows covers the steps compared, so no clean verdict is given; dump "
            "those steps again in both runs to cover them.")
    ranks = getattr(r, "ranks", None)
    if ranks is not None and (ranks["origin"] or ranks["received"]):
        lines.append(_ranks_advice(ranks, r.npu_run))
    spread = getattr(r, "ranks_divergence", None)
    # this rank only received the divergence through a collective: its cause, and what to
    # change, are the rank where it starts (named above), not this rank's collective
    received_here = spread is not None and any(
        f["run"] == r.npu_run and f["received"] for f in spread["ranks"]) and \
        all(f["run"] != r.npu_run for f in spread["first"])
    if spread is not None:
        lines.append(_spread_advice(spread, r.npu_run))
    if ranks is not None and ranks["disagree"]:
        d = ranks["disagree"][0]
        lines.append(f"The ranks disagree where replicas must agree: in step {d['step']}, "
                     f"{d['rank']}'s {d['what']} {d['tensor']} is not {ranks['first_rank']}'s "
                     f"({d['detail']}). Their updates differ: a rank's own learning rate or "
                     f"gradient scaling, a gradient left out of the all-reduce, or a collective "
                     f"that does not return the same bits everywhere.")
    first = r.first_overflow
    o = r.origin
    g = getattr(r, "golden_nonfinite", None)
    # the golden has no number where the divergence starts either (its nan/inf reached the
    # origin's inputs or outputs): the divergence is the NPU storing what the golden cannot
    # (65504 for inf...), the cause the data or the model, and range advice for the origin
    # would send the user the wrong way. A nan/inf that stops short of the origin (a dumped
    # file of a variable, say, whose golden readers came out finite) explains nothing there.
    data_first = g is not None and o is not None and g.get("at_origin", False)
    infinities: List[str] = []
    backoff = getattr(r, "backoff", None)
    if backoff:
        lines.append(_backoff_text(backoff, first))
        first = o = None            # what they would say follows from the back-off
    if getattr(r, "after_skip_replayed", None):
        lines.append(_after_skip_replayed_text(r.after_skip_replayed, r.loss_scale))
    if AFTER_SKIPPED_UPDATE in r.unseen_steps:
        lines.append(_after_skip_text(r.unseen_steps[AFTER_SKIPPED_UPDATE], r.loss_scale,
                                      r.front_end, getattr(r, "after_skip_not_replayed", "")))
    if data_first:
        lines.append(_golden_nonfinite_advice(g) + f" The divergence that starts at "
                     f"{o['op_name']} follows from it.")
    quiet_overflow = first is not None and r.overflow_without_effect
    # a first overflow that is a value the script makes itself (_script_made): its advice
    # says what it decides, in place of the range advice and of the infinities' line below
    made = _script_made(r, first) if first is not None and not quiet_overflow else ""
    if quiet_overflow:
        lines.append(f"{len(r.overflows)} kernel(s) overflowed, the first {first['op_name']} "
                     f"({first['op_type']}, {', '.join(first['status_bits'])}), without effect: "
                     f"their outputs and everything after them match the golden, so precision "
                     f"looks sound (no finding); if a later step diverges, look there first.")
    elif first is not None:
        lines.extend(_overflow_advice(r, first, o, mode, opts, made))
    if r.underflow is not None:
        where = o if o is not None and o["op_name"] in r.underflow.get("ops", []) else None
        lines.append(_underflow_advice(r.underflow, r.loss_scale, where, mode, opts))
    replayed = getattr(r, "after_skip_replayed", None) or {}
    skipped = _skipped_before(r.loss_scale, r.step, getattr(r, "golden_skipped", ()),
                              replayed.get("diverges") == r.step)
    if skipped:
        lines.append(skipped + " " + _capital(opts.tag(
            f"start the loss scale at {_scale_at(r.loss_scale, r.step):.10g}, where the manager "
            f"settled, and fewer updates are lost")[1]) + ".")
    drift = getattr(r, "drift", None)
    if r.carried is not None and not (drift and drift["kind"] == "state"):
        lines.append(_carried_advice(r.carried))         # (the drift says it)
    if drift:
        lines.append(_drift_advice(drift, r.step, r.criteria, r.front_end))
    if r.lost_updates:
        lines.append(_lost_update_advice(r.lost_updates, opts, r.front_end))
    unchecked = _unchecked_updates(r.update_check, r.front_end)
    # an origin that only underflows is the underflow advice's (a loss scale), not its own
    flushed = r.underflow is not None and o is not None and o["op_name"] in r.underflow.get("ops", [])
    if o is not None and (first is None or o["op_name"] != first["op_name"]) and not flushed \
            and not data_first and not received_here:
        lines.append(_origin_advice(r, o, mode, opts))
    if r.impact and r.impact.get("harmless_first"):
        lines.append(r.impact["harmless_first"])
    if g and not made and not data_first and not g.get("reaches") and \
            (g.get("matched") or (g.get("held") and g.get("quiet", not r.has_findings))):
        # infinities only, held by the NPU too (as inf, or saturated to 65504 where nothing
        # reading them differs): made on purpose (a mask's -inf); no cause to look for
        held = "and the NPU holds them too" if g.get("matched") else \
            "which the NPU holds saturated (±65504), and nothing that reads them differs"
        infinities = [f"The golden holds ±inf in {g['tensors']} tensor(s), the first "
                      f"{g['golden_tensor'] or g['tensor']}, {held}: infinities the script "
                      f"makes (a mask's -inf) decide nothing."]
    elif g and not made and not data_first:
        lines.append(_golden_nonfinite_advice(g))
    if r.watchpoints:
        h = r.watchpoints[0]
        lines.append(f"The training watchpoints were hit ({len(r.watchpoints)} condition(s), the "
                     f"first {h['condition']} at step {h['step']}: {h['message']}): "
                     f"precision-tool wp lists them.")
    # (a script's scaler starting too high: fix changes no scaler of a script, and says so)
    if lines and r.repairable and not data_first and r.has_findings and not received_here and \
            (first is not None or o is not None or r.underflow is not None) and \
            not _script_calibration(r) and not (made and o is None):
        how = ("it reruns the script with such calls kept in fp32 and writes what works, "
               "which torch-run --fix config/fix.json applies") \
            if r.front_end == "pytorch" else \
            "it replays the step under such changes and writes the configuration that works"
        lines.append(f"Or let the tool find and prove the smallest fix: precision-tool fix -s "
                     f"{r.step} ({how}).")
    if first is not None and r.golden_run is None:
        lines.append(f"{_with_golden(r)}: the compare says whether the overflow has an "
                     f"effect and where the divergence starts.")
    gradual = [_gradual_text(r.gradual)] if getattr(r, "gradual", None) else []
    if lines and not (r.unseen_steps and len(lines) == 1 and not r.has_findings):
        return lines + ([unchecked] if unchecked else []) + infinities + gradual
    # nothing found (in the steps compared, where some were not: that line leads)
    if r.diverging_count and getattr(r, "gradual", None):
        first = r.diverging[0].op_name if r.diverging else "?"
        return lines + [
            f"{r.diverging_count} op(s) diverge in step {r.step} with no op to start it: "
            f"they read what crossed the threshold gradually and make more of it than twice "
            f"what they read (the first: {first}). Look at what they compute from that "
            f"small difference (a division by it, a step normalised by it)."] + gradual
    if r.diverging_count:
        how = ("Dump the calls that make them too (a wider scope or list, level mix), or "
               "an earlier step" if getattr(r, "imported", False) else
               f"Compare the step against a golden replay of the NPU's own state "
               f"(precision-tool train -d cpu -s {r.step}, then vc -rt the new cpu run)")
        return lines + [
            f"{r.diverging_count} op(s) diverge but none starts it in step {r.step}: their "
            f"inputs already differ from values this dump does not show (a feed, or state). "
            f"{how}."] + gradual
    if r.golden_run is None:
        return [f"Nothing overflowed. {_with_golden(r)} to compare every op."]
    sound = _sound_text(r)
    if lines and r.unseen_steps:      # a clean verdict is for what was seen, and says so
        sound = [sound[0].replace("recision looks sound",
                                  "recision looks sound in the steps compared")]
    return lines + sound + ([unchecked] if unchecked else []) + infinities + gradual


def _gradual_text(g: dict) -> str:
    """What the ops that cross the threshold gradually are (rootcause's Gradual)."""
    first = g["first"]
    cosines = "" if first["input_cosine"] is None or first["output_cosine"] is None else \
        f": its inputs at cosine {first['input_cosine']:.8g}, its outputs at " \
        f"{first['output_cosine']:.8g}"
    lowest = "" if g["lowest_cosine"] is None else \
        f"; the lowest output cosine among them {g['lowest_cosine']:.8g}"
    return (f"In step(s) {format_steps(g['steps'])}, ops cross the threshold gradually, each "
            f"with what came in just under it and none adding as much again ({g['ops']} in "
            f"step {g['step']}, the first {first['op_name']} ({first['op_type']}){cosines}"
            f"{lowest}): the low precision's rounding growing op by op. No one op is its cause, "
            f"and it is no finding; over many steps its effect is the losses', and ac reports "
            f"a drift where they part.")


def _unchecked_updates(u: Optional[dict], front_end: str = "") -> str:
    """What the update check could not see ("" when it saw every update's change)."""
    if not u or not (u["by_statistics"] or u["unseen_count"]):
        return ""
    parts = []
    if u["by_statistics"]:
        parts.append(f"{u['by_statistics']} only by their statistics (a statistics dump: only "
                     f"an update lost whole shows)")
    if u["unseen_count"]:
        parts.append(f"{u['unseen_count']} not at all (nothing to read for "
                     f"{', '.join(u['unseen'][:3])})")
    total = u["checked"] + u["unseen_count"]
    return (f"What each update changed was compared with the golden's change element by "
            f"element for {u['checked'] - u['by_statistics']} of {total} updated variable(s); "
            + " and ".join(parts) + ": an update lost below its weight's ulp may not show. "
            f"Dump tensors of a step ({_tensor_dump_option(front_end)}) to check every element.")


def _tensor_dump_option(front_end: str) -> str:
    """The option that dumps tensors, in the runner the run came from."""
    return "torch-run --dump-mode tensor" if front_end == "pytorch" else "--dump-data tensor"


def _sound_text(r) -> List[str]:
    if r.no_effect:
        first = r.no_effect["first"][0]
        return [f"Nothing overflowed, and what diverges ({r.no_effect['ops']} op(s), the first "
                f"{first['op_name']}) has no effect: the ops that read it match the golden, and "
                f"no output, loss or update moves. Precision looks sound."]
    if r.cancellations:
        return [f"Nothing overflowed, and the only ops that diverge hold rounding noise and "
                f"nothing more ({len(r.cancellations)} op(s), among them {r.cancellations[0]}): "
                f"a result that is zero up to rounding noise in both runs (cancellation), an "
                f"update that writes what such noise made, or an Adam step that turns the "
                f"rounding of near-zero gradient elements into full steps: precision looks "
                f"sound."]
    return ["No op diverges and nothing overflowed: precision looks sound."]


def _golden_nonfinite_advice(g: dict) -> str:
    reaches = f", and it reaches {g['reaches']}, which nothing in the step reads (the loss, " \
              f"an output or an update)" if g.get("reaches") else ""
    return (f"The golden run itself holds nan/inf: {g['tensors']} tensor(s), the first "
            f"{g['golden_tensor'] or g['tensor']} ({g['nonfinite']} element(s)){reaches}. That "
            f"is the data or the model, not the NPU: precision-tool check names it where it "
            f"comes from a feed or a learning rate too high; else follow it from that first "
            f"tensor (vc's CSV has each golden tensor's nan/inf counts).")


def _overflow_advice(r, op: dict, origin: Optional[dict], mode: str, opts: Options,
                     made: str = "") -> List[str]:
    text = f"The first overflow is {op['op_name']} ({op['op_type']}, {', '.join(op['status_bits'])})"
    inputs = [t for t in op.get("tensors", []) if t["io"] == "input" and t["max"] == t["max"]]
    peak = max((max(abs(t["max"]), abs(t["min"])) for t in inputs), default=None)
    if peak is not None:
        text += f"; its inputs reach {peak:.6g}"
    text += "."
    if made:                    # (_script_made's, for this op)
        return [text + made]
    scales = _scales(r.loss_scale)
    if peak is not None and peak > numerics.FP16_MAX and peak in scales:
        start = opts.tag("start it lower (" + _dynamic_scale(opts, "2**15") + " or less) and "
                         "no step is lost",
                         [Change("loss_scale", "loss_scale", 2.0 ** 15)])
        return [text + f" That is the loss scale itself: {peak!r} does not fit in fp16, so each "
                f"step overflows and is skipped until the dynamic manager has shrunk it below "
                f"65504. {opts.only(start)}."]
    if op.get("carries"):
        return [text + f" Its inputs already diverge: it carries the divergence that starts "
                f"upstream at {op['carries']}, which is what to fix."]
    # an input fp16 cannot hold overflows in whichever kernel reads it in fp16: what feeds
    # it is the thing to change, a fusion pass is not (its options come last, unless verified)
    beyond = peak is not None and peak > numerics.FP16_MAX
    if beyond:
        text += (f" That is beyond fp16's largest value ({numerics.FP16_MAX:g}), fused kernel "
                 f"or not.")
    if origin is not None and origin["op_name"] == op["op_name"] and origin.get("pass_name"):
        p = origin["pass_name"]
        choices = [opts.tag(f"switch {p} off in fusion_switch.cfg", [Change("fusion", p)]),
                   opts.keep(origin, mode), opts.tag("normalise what feeds it")]
        confirm = "" if beyond else " (precision-tool fo confirms it)"
        return [text + f" It is also where the divergence starts, fused by {p}{confirm}: "
                + opts.either(*(choices[::-1] if beyond else choices)) + "."]
    later = _later_overflows(r)
    if is_backward(op["op_name"]) and scales:
        history = LossScaleHistory(**r.loss_scale)
        settled = history.settling_from(r.step)
        if settled:
            skipped, clean, scale = settled
            seen = (f"step(s) {format_steps(skipped)} overflowed and skipped their update "
                    f"while the dynamic manager brought the scale down from "
                    f"{_scale_at(r.loss_scale, r.step):.10g} to {scale:.10g}, where step "
                    f"{clean} ran without overflow")
            again, scale, ran = history.held_after(clean)
            lost = " and no step is lost"
            if again:
                seen += (f"; step(s) {format_steps(again)} overflowed again, and from there "
                         f"the scale is {scale:.10g}" +
                         (", which the steps after held" if ran else
                          ", which no observed step after tried"))
                lost = lost if ran else ""
            if r.front_end == "pytorch":    # the script's own scaler: fix changes none
                return [text + " It is in the backward pass, and the loss scale starts too "
                        f"high: {seen}. Start the script's scaler there{lost} "
                        f"(torch.amp.GradScaler(init_scale={scale:.10g}); not verified)."
                        + later]
            start = opts.tag(f"start the loss scale at {scale:.10g}{lost}",
                             [Change("loss_scale", "loss_scale", scale)])
            return [text + " It is in the backward pass, and the loss scale starts too high: "
                    + seen + ". " + _capital(opts.either(start, opts.keep(op, mode))) + "."
                    + later]
        lower = _lower_scale(_scale_at(r.loss_scale, r.step), peak)
        return [text + " It is in the backward pass under loss scaling: " + opts.either(
            opts.tag(f"lower the loss scale to {lower:g} (or let a dynamic manager shrink it)",
                     [Change("loss_scale", "loss_scale", lower)]) if lower else
            opts.tag("lower the loss scale (or let a dynamic manager shrink it)"),
            opts.keep(op, mode)) + "." + later]
    choices = [opts.keep(op, mode)]
    if op.get("pass_name"):
        how = " (torch-run --fusion-switch; precision-tool fo reruns the script to confirm)" \
            if op.get("api_call") else ""
        choices.insert(0, opts.tag(f"switch {op['pass_name']} off in fusion_switch.cfg{how}",
                                   [Change("fusion", op["pass_name"])]))
    if not op.get("inserted"):
        choices.append(opts.tag("scale what feeds it down"))
    return [text + " " + _capital(opts.either(*(choices[::-1] if beyond else choices))) + "."
            + later]


def _parted_text(steps, parted: dict) -> str:
    """Steps whose runs took different paths: where, and what that leaves unjudged."""
    first = parted[steps[0]]
    where = ", ".join(x for x in (f"module {first['module']}" if first.get("module") else "",
                                  first.get("source", "")) if x)
    return (f"In step(s) {format_steps(steps)} the runs take different paths: "
            f"{first['tensor']} ({first['dtype']}{', ' + where if where else ''}), an index "
            f"or a mask, differs from the golden's before any shape does" +
            (f" (in step {steps[0]})" if len(steps) > 1 else "") +
            ": a decision (a top-k, an argmax, a comparison) that the low precision of what "
            "feeds it flipped. What follows it has other shapes and is not compared, so no "
            "clean verdict is given for those steps; to see whether the rest matches, keep "
            "what feeds that decision in fp32 (a router, a gate) and compare again.")


def _script_made(r, op: dict) -> str:
    """What to say of a first overflow whose inf/nan the golden's output holds too, where
    the NPU's loss scale skipped updates the golden took: the script makes that value on
    purpose (T5's log of a zero distance, masked after), no precision is lost, and in
    saturation mode the device's status word flags it all the same, so a scaler that reads
    the flag skips every step it is in. Empty where that is not the case."""
    g = getattr(r, "golden_nonfinite", None)
    history = r.loss_scale or {}
    skipped = sorted(set(history.get("skipped_steps", ())) - set(r.golden_skipped))
    if not (g and g.get("matched") and g["tensor"].startswith(op["op_name"] + ":") and
            skipped and r.overflow_mode == "saturation"):
        return ""
    how = "torch-run --overflow-mode inf_nan" if r.front_end == "pytorch" else \
        "overflow_mode='inf_nan' in the session's config"
    return (f" The script makes that value itself: the golden's output holds it too "
            f"({g['nonfinite']} element(s)), and what reads it matches. In saturation "
            f"mode the device's status word flags it all the same, and the loss scaler, "
            f"which reads that flag, skipped the update of {len(skipped)} of "
            f"{history.get('steps', len(skipped))} observed step(s) that the golden took. "
            f"Run in inf_nan mode ({how}: the scaler checks the gradients, which hold no "
            f"inf), or keep {op['op_type']} from making it (e.g. its input kept off the "
            f"value that makes it); not verified.")


def _script_calibration(r) -> bool:
    """Whether a script's step overflows only in the backward while its loss scale, from the
    first observed step on, comes down to one that holds (scale_history.settling_from)."""
    return r.front_end == "pytorch" and bool(r.loss_scale) and calibration(
        LossScaleHistory(**r.loss_scale), r.step, [t["op_name"] for t in r.overflows]) is not None


def _later_overflows(r) -> str:
    """What the overflows after the first are: carried (their inputs hold inf/nan, or values
    saturated at fp16's maximum) or their own (finite inputs within range: a scaled backward
    that overflows in several places at once). Empty when there are none."""
    later = r.overflows[1:]
    if not later:
        return ""
    own = [t["op_name"] for t in later if t.get("inputs_finite", True) and all(
        max(abs(x["max"]), abs(x["min"])) < numerics.FP16_MAX
        for x in t.get("tensors", []) if x["io"] == "input" and x["max"] == x["max"])]
    if not own:
        return f" The {len(later)} later overflow(s) read what it produced: they carry it."
    return (f" {len(own)} of the {len(later)} later overflow(s) happen on their own (finite "
            f"inputs within fp16's range, the first {own[0]}): fixing this one alone may not "
            f"be enough.")


def _underflow_advice(u: dict, history: Optional[dict], origin: Optional[dict], mode: str,
                      opts: Options) -> str:
    scale = history["first_scale"] if history and history["first_scale"] == history["first_scale"] else 1.0
    text = (f"Gradients underflow: {u['tensors']} tensor(s) lose up to {u['worst'] * 100:.4g}% of "
            f"their non-zero elements to zero in fp16, the first {u['first']}.")
    if not u.get("gradients"):
        keep = opts.keep(origin, mode) if origin is not None else \
            opts.tag("keep those ops in fp32")
        # a value cast in (data, a constant) is what to change, and an update's state (an
        # optimizer's moment) is kept in fp32, not scaled; an op's inputs can be scaled
        how = keep[1] if origin is not None and (origin.get("inserted") or origin.get("update")) \
            else opts.either(opts.tag("scale what feeds them up"), keep)
        return text.replace("Gradients underflow", "Values underflow") + f" {_capital(how)}."
    new = suggested_scale(scale, u.get("peak"))
    if new is not None:
        scaled = opts.tag(f"a static loss scale of {new:g} (2**{int(math.log2(new))}; the "
                          f"largest gradient then stays under 65504 with room to spare), or a "
                          f"dynamic manager starting there ({_dynamic_scale(opts, f'{new:g}')})",
                          [Change("loss_scale", "loss_scale", new)])
        if scaled[0] == 2:
            return text + f" {opts.only(scaled)}."
        return text + f" Scale the loss: {scaled[1]}."
    return (text + " A larger loss scale has no room (the largest gradients are near 65504 "
            "already): keep the gradient ops that flush in fp32 (not verified).")


def _lost_update_advice(u: dict, opts: Options, front_end: str = "") -> str:
    first = u["lost"][0]
    how_to = ("the model in float32 (no .half() or .bfloat16() of it) and its compute cast "
              "down by torch.autocast" if front_end == "pytorch" else
              "declare the variables float32 and let the compute cast them down")
    more = f" ({len(u['lost'])} variables in all)" if len(u["lost"]) > 1 else ""
    how = ("did not move at all (its statistics are the same before and after the update; "
           "the golden's changed)" if first.get("by_statistics") else
           f"did not move in {first['share'] * 100:.4g}% of the elements the golden's update "
           f"moved ({first['energy'] * 100:.3g}% of its change)")
    # the op said: an optimizer's weight decay (param.mul_) is lost as surely as its step
    return (f"Updates are lost: {first['variable']} ({first['dtype']}) {how} at "
            f"{first['op_name']}{more}: a step under half an ulp of the weight rounds away in "
            f"its dtype, so what that update does is lost while every value still matches. "
            + _capital(opts.tag("keep fp32 master weights")[1])
            + f": {how_to} (a larger learning rate would only hide it).")


def _drift_advice(d: dict, step: int, criteria: Optional[dict], front_end: str = "") -> str:
    """Drift (analysis.diagnosis.drift): the state's, the step sound; or the losses' in steps whose
    compare finds nothing."""
    tol = (criteria or {}).get("rel_error", 0.05)
    fp64 = ("precision-tool torch-run --target golden --golden-dtype float64 -- <your "
            "training command>" if front_end == "pytorch" else
            "SessionConfig(golden_dtype='float64')")
    gap = d["loss"]
    state = d["state"]["variables"]
    furthest = "; ".join(
        f"{v['variable']} {v['distance']:.3g}" + (
            f" (from {v['before'][min(v['before'])]:.3g} at step {min(v['before'])})"
            if v["before"] else "") for v in state) or "no variable read differs"
    losses = ""
    if gap["steps"]:
        losses = (f" The losses (step histories, {gap['steps']} steps): " +
                  (f"first more than {tol * 100:g}% apart at step {gap['first_off']}, "
                   if gap["first_off"] is not None else f"within {tol * 100:g}% at every step, ")
                  + f"{gap['worst'] * 100:.3g}% at worst (step {gap['worst_step']}).")
    replayed = (f"replayed on the golden from the NPU's own state ({d['replayed_by']}, a "
                f"rerun of the script)" if d.get("replayed_by") else
                "replayed from the NPU's own state (its replay bundle)")
    shows_at = f" (what diverges shows first at {d['shows_first']})" \
        if d.get("shows_first") else ""
    if d["kind"] == "state" and d["own"] is None:
        shows = f" (it shows first at {d['shows_first']}, whose inputs pass)" \
            if d["shows_first"] else ""
        return (f"Step {step} starts from a state that already differs from the golden's "
                f"beyond the criteria, left by rounding that was no finding where it was "
                f"written (from step {d['written_at']} on: cancellation noise, or rounding "
                f"that crossed the threshold gradually); the variables furthest from the "
                f"golden's (relative distance): {furthest}.{losses} What diverges in step "
                f"{step} may be only that state's difference carried through the step{shows}:"
                f" no op is blamed for it, and none is to keep in fp32. The step was not "
                f"replayed from the NPU's own state ({d.get('not_replayed') or 'no bundle'}),"
                f" so that is not proven: dump a "
                f"golden run in float64 ({fp64}) and compare the two goldens to see whether "
                f"the training itself is that sensitive.")
    if d["kind"] == "state" and d["own"]:
        return (f"Most of what diverges in step {step} came in with the state, off the "
                f"golden's by a little more each step (relative distance when it starts: "
                f"{furthest}).{losses} {_capital(replayed)}, the step still fails in "
                f"{len(d['own'])} output(s) or update(s), the first "
                f"{d['own'][0]}: that much is the step's own; the rest is rounding that "
                f"compounds over the steps.")
    if d["kind"] == "state":
        proven = (f"The runs drift apart through the state: {replayed}, step {step} computes "
                  f"as the golden does, every output and update within the criteria, so no op "
                  f"or setting of this step is to blame{shows_at}. The variables furthest "
                  f"from the golden's when it starts (relative distance): {furthest}.{losses}")
        if gap["steps"] and gap["first_off"] is None:
            # the losses hold too: it changes no output (AutoCheck.drift_matters)
            return proven + (" The drift changes no loss beyond the criteria: no finding; if "
                             "the losses part later, ac says so.")
        return proven + (f" Rounding the criteria pass at every step compounds through the "
                         f"training (a high learning rate or an unstable model amplifies it; "
                         f"two fp32 runs that sum in another order part too): dump a golden "
                         f"run in float64 ({fp64}) and compare the two goldens to see whether "
                         f"the training itself is that sensitive.")
    first = gap["first_off"]
    compared = set(d.get("compared", ()))
    if {max(first - 1, 0), first} <= compared:
        # the steps to look at were dumped and compared already: what else they can say
        more = (f"Dump their tensors (precision-tool torch-run --dump-mode tensor --dump-step "
                f"\"{max(first - 1, 0)}-{first}\" -- <your training command>) to compare them "
                f"element by element." if d.get("by_statistics") and front_end == "pytorch"
                else f"Dump their tensors (--dump-data tensor) to compare them element by "
                f"element." if d.get("by_statistics") else
                f"The runs drift apart: rounding the criteria pass at every step compounds "
                f"through the training. Dump a golden run in float64 ({fp64}) and compare the "
                f"two goldens to see whether the training itself is that sensitive.")
        return (f"The losses part while every dumped step matches:{losses} Steps "
                f"{max(first - 1, 0)}-{first} were dumped and compared"
                f"{' by their statistics' if d.get('by_statistics') else ''}, and no op there "
                f"diverges beyond the criteria; the difference accumulates in the state, "
                f"furthest from the golden's at step {d['state']['step']}: {furthest}. {more}")
    steps = f"\"{max(first - 1, 0)}-{first}\""
    dump = (f"precision-tool torch-run --dump-step {steps} -- <your training command>"
            if front_end == "pytorch" else
            f"precision-tool npu-dump --dump-step {steps} -- <your training command>, and "
            f"cpu-dump likewise")
    return (f"The losses part while every dumped step matches:{losses} The difference "
            f"accumulates in the state, furthest from the golden's at step "
            f"{d['state']['step']}: {furthest}. Dump step {first} and the steps before it "
            f"({dump}) and run ac -c again to see whether a step there computes wrongly or "
            f"the runs only drift.")


def _carried_advice(c: dict) -> str:
    names = ", ".join(c["variables"][:3]) + (f" and {len(c['variables']) - 3} more"
                                             if len(c["variables"]) > 3 else "")
    text = f"The divergence of step {c['step']} came in with the state: {names} already differ when it starts."
    if c.get("writers_noise"):
        return (f"{names} already differ when step {c['step']} starts, written in step "
                f"{c['written_at']} by {', '.join(c['writers'][:3])} from rounding noise (a "
                f"gradient that is zero up to rounding, or rounding that crossed the threshold "
                f"gradually): the state carries that noise, and what reads it is no "
                f"finding.")
    if c.get("written_at") is not None:
        return (text + f" Step {c['written_at']} wrote the first diverging value "
                f"({', '.join(c['writers'][:3])}): see precision-tool ac -c -s {c['written_at']}.")
    if c.get("missing"):
        a, b = c["missing"]
        return (text + f" It was written in steps {a}-{b}, which were not dumped: "
                f"dump them ({c['command']}) and run ac -c again.")
    return text + " Where it was written is not in the dumped steps."


def _origin_advice(r, o: dict, mode: str, opts: Options) -> str:
    fused = f", fused by {o['pass_name']}" if o.get("pass_name") else ""
    why = f" ({'; '.join(dict.fromkeys(o['reasons']))})" if o.get("reasons") else ""
    replay = r.origin_replay or ""
    head = f"The divergence starts at {o['op_name']} ({o['op_type']}{fused}){why}."
    if o.get("inputs_off", 0.0) > 1e-3:
        dump = (f"precision-tool torch-run --dump-mode tensor --dump-step {r.step} -- <your "
                f"training command>" if r.front_end == "pytorch" else
                f"precision-tool npu-dump --dump-data tensor --dump-step {r.step} -- <your "
                f"training command>, and cpu-dump likewise")
        head += (f" By statistics only: its inputs' norms already differ from the golden's "
                 f"by up to {o['inputs_off'] * 100:.4g}% (within the criteria), and norms "
                 f"cannot tell its own error from theirs made larger (a sum that cancels, a "
                 f"gradient's mask): dump tensors of step {r.step} ({dump}) and run ac -c "
                 f"again before changing anything.")
    if o.get("unseen_inputs"):
        head += (f" As far as the compare saw: {', '.join(o['unseen_inputs'])} could not be "
                 f"compared, and the divergence may come in through it.")
    if replay == "inherited":
        return (head + " Its single-op replay says its own numerics are exact: it amplifies "
                "differences its inputs bring, small as they are. Look at what feeds it "
                f"(precision-tool ni {o['op_name']} -s 2).")
    # what to change, after the tensors where statistics could not decide
    lead = (lambda text: "If they confirm it: " + text[0].lower() + text[1:]) \
        if o.get("inputs_off", 0.0) > 1e-3 else _capital
    if o.get("pass_name"):
        return (head + " " + lead(opts.either(
            opts.tag(f"switch {o['pass_name']} off in fusion_switch.cfg (precision-tool fo "
                     f"replays the step with fusion off)", [Change("fusion", o["pass_name"])]),
            opts.keep(o, mode))) + ", and compare again.")
    keep = opts.keep(o, mode)
    return head + " " + lead(opts.only(keep)) + ("." if keep[0] == 2 else
                                                   ", and compare again.")


def _skipped_before(history: Optional[dict], step: int, golden_skipped=(),
                    replayed: bool = False) -> str:
    """The steps before `step` whose update a dynamic loss scale skipped and the golden took
    (the state differs from there on, unless the step is compared with the golden started
    from the NPU's state: replayed), as a sentence; "" when none (or the golden skipped
    them too)."""
    if not history or history["first_scale"] != history["first_scale"]:
        return ""
    skipped = [s for s in history["skipped_steps"] if s < step and s not in golden_skipped]
    if not skipped:
        return ""
    return (f"{len(skipped)} of the {step} steps before step {step} overflowed and skipped "
            f"their update ({format_steps(skipped)}) while the dynamic loss scale came down "
            f"from {history['first_scale']:.10g} to {_scale_at(history, step):.10g}" +
            ("." if replayed else f": the golden took those updates, so the state differs "
                                  f"from it from step {skipped[0]} on."))


def _after_skip_text(steps: List[int], history: Optional[dict], front_end: str,
                     not_replayed: str = "") -> str:
    how = ("rerun with torch-run --golden-skips-as-npu (the golden then skips those updates "
           "too) and compare again") if front_end == "pytorch" else \
        (f"start the loss scale lower ({_scale_at(history, steps[0]):.10g} or below) so that "
         f"no update is skipped, dump again and compare")
    which = f"Step {steps[0]} diverges" if len(steps) == 1 else \
        f"Steps {format_steps(steps)} diverge"
    return (f"{which} {_after_skipped(history, steps[0])}: their state differs from the "
            f"golden's by that, so what diverges there cannot be told from it, and no clean "
            f"verdict is given for them" +
            (f" (not judged from the NPU's state: {not_replayed})" if not_replayed else "") +
            f". To judge them, {how}.")


def _after_skip_replayed_text(judged: dict, history: Optional[dict]) -> str:
    """Steps after a skipped update, judged against the golden from the NPU's state: those
    that match, and the one reported that diverges there too."""
    steps, diverges = judged["steps"], judged.get("diverges")
    after = _after_skipped(history, steps[0] if steps else diverges)
    where = (f"the golden started from the NPU's own state ({judged['replayed_by']}, a rerun "
             f"of the script)")
    text = ""
    if steps:
        which = f"Step {steps[0]} comes" if len(steps) == 1 else \
            f"Steps {format_steps(steps)} come"
        text = (f"{which} {after}. Judged against {where}, "
                f"{'it computes' if len(steps) == 1 else 'they compute'} as the golden does: "
                f"no finding.")
    if diverges is not None:
        text += (f" Step {diverges} " if steps else f"Step {diverges} comes {after}: it ")
        text += ("could not be compared in full with " + ("that replay" if steps else where) +
                 ", and what is missing is said here; what was compared matches it."
                 if judged.get("unseen_only") else
                 ("diverges from that replay too: it is compared with it here"
                  if steps else f"is compared with {where}") + ", and what follows is its own.")
    return text


def _after_skipped(history: Optional[dict], step: int) -> str:
    """"after the update(s) of step(s) ..." that the loss scale skipped before `step`."""
    skipped = [s for s in (history or {}).get("skipped_steps", []) if s < step]
    return (f"after the update(s) of step(s) {format_steps(skipped)}, which the loss scale "
            f"skipped and the golden took")


def _backoff_text(b: dict, first: Optional[dict]) -> str:
    where = f" (the first {first['op_name']}, {', '.join(first['status_bits'])})" \
        if first else ""
    head = (f"Step {b['step']}'s backward overflowed at loss scale {b['scale']:.10g}{where}: "
            f"the dynamic loss scale skipped that update and lowered the scale to "
            f"{b['next_scale']:.10g}")
    tail = (f" ({b['skipped']} of {b['observed']} observed steps skipped), not a finding: "
            f"whatever diverges in the step's backward follows from the overflow, and the "
            f"update it would reach was not applied.")
    if b.get("kind") == "calibration":
        return (head + f", and step {b['after']} ran without overflow at "
                f"{b['settled']:.10g}. That is the loss scale settling from where it started, "
                f"as designed" + tail + f" Starting it at {b['settled']:.10g} would keep the "
                f"update(s) it skipped meanwhile.")
    after = f" and step {b['after']} after it" if b["after"] is not None else ""
    return (head + f", and step {b['before']} before it{after} ran without overflow. That is "
            f"the loss scale backing off as designed" + tail + " Only steps skipped often "
            f"(the Loss scale box counts them) cost training.")


def _scale_at(history: Optional[dict], step: int) -> Optional[float]:
    """The loss scale a step ran with, from the history (AutoCheck.loss_scale)."""
    return LossScaleHistory(**history).scale_at(step) if history else None


def _lower_scale(scale: Optional[float], peak: Optional[float]) -> Optional[float]:
    """A power-of-two loss scale under which `peak` (reached at `scale`) would sit under
    fp16's maximum with a factor of 2 to spare; None without a finite peak above it."""
    if not scale or peak is None or not math.isfinite(peak) or peak <= numerics.FP16_MAX / 2:
        return None
    return scale * 2.0 ** math.floor(math.log2(numerics.FP16_MAX / (2 * peak)))


def _scales(history: Optional[dict]) -> set:
    """Every loss-scale value a run's history shows."""
    if not history or history["first_scale"] != history["first_scale"]:
        return set()
    return {history["first_scale"]} | {m[1] for m in history["moves"]}


def _with_golden(r) -> str:
    """How to compare with a golden run: add -c when one is dumped, else dump it first."""
    if getattr(r, "golden_dumped", False):
        return "A golden run is dumped, so add -c"
    return f"Dump the golden run too ({_golden_dump(r)}) and add -c"


def _golden_dump(r) -> str:
    """How the reference run the compare needs is made, for this run's kind."""
    if getattr(r, "imported", False):
        return "the same script's msprobe dump on a GPU or CPU, then ac -c -lt DUMP -rt " \
               "BASELINE_DUMP"
    return "torch-run --target golden" if r.front_end == "pytorch" else "cpu-dump"


def _ranks_advice(ranks: dict, compared: str) -> str:
    """Where a nan/inf first appears across the ranks (diagnosis.ranks), and which rank to
    look at."""
    step = ranks["step"]
    carried = ", ".join(f"{e['rank']} by {e['op_name']}" for e in ranks["received"])
    if not ranks["origin"]:
        return (f"In step {step} every rank's first nan/inf came through a collective "
                f"({carried}): {ranks['note']}.")
    first = ranks["origin"]
    where = " and ".join(f"{e['rank']} ({e['run']}) at {e['op_name']}"
                         + (f" ({e['source']})" if e["source"] else "") for e in first)
    text = (f"nan/inf first appears in step {step} on {where}, before collective "
            f"{first[0]['epoch']} of the step" +
            (f"; collectives carried it to the other ranks ({carried})" if carried else "") +
            ".")
    if all(e["run"] != compared for e in first):
        text += f" Look at that rank: ac -c -lt {first[0]['run']}."
    return text


def _spread_advice(spread: dict, compared: str) -> str:
    """Where a divergence from the reference first appears across ranks."""
    first = spread["first"]
    where = " and ".join(f"{f['rank']} ({f['run']}) at {f['op_name']}" for f in first)
    others = [f for f in spread["ranks"] if f not in first]
    text = (f"Of {spread['compared']} ranks compared with their own reference in step "
            f"{spread['step']}, the divergence first appears on {where}, before collective "
            f"{first[0]['epoch']}")
    if others:
        text += "; " + ", ".join(f"{f['rank']} diverges from {f['op_name']}"
                                 + (" (received)" if f["received"] else "") for f in others)
    text += "."
    if all(f["run"] != compared for f in first):
        text += f" Look at that rank: ac -c -lt {first[0]['run']}."
    return text
