"""The diagnosis on realistic causes it was not built around (tests/scenarios.py): for each
scenario `ac -c` names the origin, the first overflow, the step and advice that applies, and
exits as it should; clean runs (fp32 against itself and against fp64, bf16, fp16 rounding
only, several steps) exit 0."""
import json
import os

import pandas as pd
import pytest
from click.testing import CliRunner

from precision_tool.cli import cli
from harness import recorded_as
from scenarios import SCENARIOS, run_ac


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    """Each scenario's workspace, built once when a test first asks for it."""
    built = {}

    def get(name):
        if name not in built:
            root = str(tmp_path_factory.mktemp(name) / "precision_data")
            SCENARIOS[name].build(root)
            built[name] = root
        return built[name]
    return get


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ac_tells_what_a_user_who_knows_the_cause_would_accept(workspaces, name):
    s = SCENARIOS[name]
    code, result, text = run_ac(workspaces(name), s)
    assert code == s.exit_code, (name, text)
    assert "Traceback" not in text
    origin = (result.get("origin") or {}).get("op_name", "")
    if s.origin is not None:
        assert (s.origin in origin) if s.origin else origin == "", (name, origin)
    first = (result.get("first_overflow") or {}).get("op_name", "")
    if s.first_overflow is not None:
        assert (s.first_overflow in first) if s.first_overflow else first == "", (name, first)
    if s.step is not None:
        assert result["step"] == s.step
    advice = " ".join(result["advice"])
    for phrase in s.advice:
        assert phrase in advice, (name, phrase, advice)
    for phrase in s.not_advice:
        assert phrase not in advice, (name, phrase, advice)
    if s.exit_code == 0:
        assert result["verdict"] == "sound" and "sound" in text
    else:
        assert "precision looks sound" not in advice
    # an origin whose outputs diverge for one reason says it once
    reasons = (result.get("origin") or {}).get("reasons") or []
    if len(set(reasons)) < len(reasons):
        assert "; ".join(reasons) not in advice, (name, reasons)
    # the evidence that decided each diverging op is shown with it
    for op in result["diverging"]:
        assert any(op["output_reasons"]), op["op_name"]


ALSO = [(name, k) for name, s in SCENARIOS.items() for k in range(len(s.also))]


@pytest.mark.parametrize("name, k", ALSO)
def test_other_commands_on_the_scenario_say_what_they_should(workspaces, name, k):
    """The scenario's other commands (fo, check, vc, train -a overflow, ac without -c): the
    exit code, and phrases their output must and must not hold."""
    args, code, phrases, absent = SCENARIOS[name].also[k]
    r = CliRunner().invoke(cli, ["--data-dir", workspaces(name), "--log-level", "4", *args],
                           env={"COLUMNS": "400"})
    assert r.exit_code == code, (name, args, r.output)
    assert "Traceback" not in r.output
    text = " ".join(r.output.split())
    for phrase in phrases:
        assert phrase in text, (name, args, phrase, text[-2000:])
    for phrase in absent:
        assert phrase not in text, (name, args, phrase)


def test_the_verdict_fields_are_in_the_json_of_vc_vcs_and_ac(workspaces):
    root = workspaces("input_saturation")
    runner = CliRunner()

    def as_json(*args):
        r = runner.invoke(cli, ["--data-dir", root, "--json", "--log-level", "4", *args])
        return json.loads(r.stdout)
    vc = as_json("vc")
    table = pd.read_csv(vc["result_file"])
    for column in ("CosineSimilarity", "NormRelativeDiff", "FlushedToZeroRatio", "NpuAtFp16Max",
                   "NpuNanCount", "NpuInfCount", "RelativeEuclideanDistance", "Verdict", "Reason"):
        assert column in table, column
    assert vc["criteria"] == {"cosine": 0.98, "norm": 0.1, "flushed": 0.05, "rel_error": 0.05,
                              "small_size": 4}
    cast = table[(table.NPUDump == "x/Cast_fp16") & table.TensorIndex.str.contains(":output:")]
    assert "at 65504" in cast.Reason.iloc[0] and "norm -" in cast.Reason.iloc[0]
    vcs = as_json("vcs", "-l", "0")
    op = next(o for o in vcs["ops"] if o["op_name"] == "x/Cast_fp16")
    assert "at 65504" in op["output_reasons"][0]
    ac = as_json("ac", "-c")
    assert ac["criteria"]["norm"] == 0.1 and "at 65504" in " ".join(ac["origin"]["reasons"])


def test_a_loss_a_tenth_off_fails_though_its_cosine_is_1():
    from precision_tool.analysis import compare_tensors, verdict
    import numpy as np
    row = compare_tensors(np.array(1.1, np.float32), np.array(1.0, np.float32))
    assert row["CosineSimilarity"] == 1.0 and verdict(row) == "fail"
    assert verdict(compare_tensors(np.array(1.001, np.float32), np.array(1.0, np.float32))) == "pass"


def test_single_op_replay_calls_an_op_that_makes_inf_from_finite_inputs_local(workspaces):
    for name in ("input_inf_nan", "input_saturation"):
        _, result, _ = run_ac(workspaces(name), SCENARIOS[name])
        assert result["origin_replay"] == "local", name


def test_fusion_off_replay_blames_fusion_for_an_overflow(workspaces):
    root = workspaces("softmax_overflow")
    r = CliRunner().invoke(cli, ["--data-dir", root, "--json", "--log-level", "4", "fo"])
    verdict = json.loads(r.stdout)
    assert r.exit_code == 1 and verdict["fusion_to_blame"]
    assert verdict["culprits"] == ["SoftmaxFusionPass"]
    assert any("overflow" in f or "Softmax" in f for f in verdict["new_failures"])
    # a run where fusion changes nothing: never "the same tensors diverge"
    clean = workspaces("clean_fp32_fused")
    text = CliRunner().invoke(cli, ["--data-dir", clean, "fo"])
    assert text.exit_code == 0 and "same tensors diverge" not in text.stdout


def test_mixlist_advice_names_the_types_a_policy_placed():
    """A UB-fused elementwise kernel was placed op by op before fusion: the black-list names
    its steps' types, never "FusedEltwise"; an inserted Cast names what it casts."""
    from precision_tool.analysis.advice import keep_in_fp32
    fused = {"op_name": "norm/Rsqrt", "op_type": "FusedEltwise",
             "policy_types": ["Add", "Rsqrt"]}
    text = keep_in_fp32(fused, "allow_mix_precision")
    assert '"to-add": ["Add", "Rsqrt"]' in text and "FusedEltwise" not in text
    assert "allow_mix_precision with modify_mixlist" in keep_in_fp32(fused, "force_fp16")
    cast = {"op_name": "x/Cast_fp16", "op_type": "Cast", "inserted": True,
            "source": {"name": "x", "type": "Placeholder", "peak": 1e5}}
    assert keep_in_fp32(cast, "force_fp16").startswith("normalise or scale what is fed to x")
    const = dict(cast, source={"name": "eps", "type": "Const", "peak": 1e-12})
    assert keep_in_fp32(const, "force_fp16").startswith("give the constant eps a value fp16 holds")


def test_an_origin_whose_golden_output_its_dtype_cannot_hold_is_not_ranked():
    """Handing on the golden's 1e-12 in fp16 hands on the NPU's own 0: such a replay neither
    clears nor acquits the op, so it is said and not ranked."""
    import numpy as np
    from precision_tool.analysis.replays.impact import _unfit
    from precision_tool.graph import NodeView
    node = NodeView("mm", "MatMul", [], {}, [{"dtype": "float16"}])
    assert "does not fit float16" in _unfit(node, {0: np.array([1e-12, 1.0])})
    assert "does not fit float16" in _unfit(node, {0: np.array([1e5])})
    assert _unfit(node, {0: np.array([1e-3, 60000.0])}) == ""
    assert _unfit(node._replace(outputs=[{"dtype": "float32"}]), {0: np.array([1e-12])}) == ""


def _exp_into_matmul(root, x_value=None):
    """exp(12 tanh(.)) in fp32 (Exp is black-listed) read by an fp16 MatMul under
    allow_mix_precision, inf_nan: the Cast the compiler puts between them overflows."""
    import numpy as np
    import precision_tool as pt
    from test_repair import Net, dump_step
    g = pt.Graph("exp_into_matmul", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 16])
        y = pt.placeholder("y", [None], "int32")
        h = pt.ops.exp(pt.ops.tanh(pt.nn.dense(x, 16, name="fc1")) * pt.constant(12.0, name="k"))
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(
            pt.nn.dense(h, 10, name="out"), y))
        train = pt.train.Adam(0.01).minimize(loss)
    rng = np.random.default_rng(0)
    xb = rng.normal(size=(32, 16)).astype(np.float32) * 3
    if x_value is not None:
        xb[0, 0] = x_value
    net = Net(g, [x], y, loss, train, [([xb], rng.integers(0, 10, 32).astype(np.int32))])
    return dump_step(root, net, pt.SessionConfig(precision_mode="allow_mix_precision",
                                                 overflow_mode="inf_nan"))


def test_an_inserted_cast_of_a_computed_value_is_advised_by_what_reads_it(tmp_path):
    """Its producer is already fp32; what moves the Cast away is keeping its readers in fp32."""
    from precision_tool.analysis import auto_check
    result = auto_check(_exp_into_matmul(tmp_path), compare=True)
    assert result.first_overflow["op_name"] == "Exp/Cast_fp16"
    advice = " ".join(result.advice)
    assert '"MatMul"' in advice and "keep the producer" not in advice.lower(), advice
    assert result.golden_nonfinite is None and "golden run itself" not in advice


def test_nan_or_inf_in_the_golden_run_is_said_to_be_the_data(tmp_path):
    """An inf fed to both runs: the golden holds it too, and the advice says whose it is."""
    import math
    from precision_tool.analysis import auto_check
    result = auto_check(_exp_into_matmul(tmp_path, x_value=math.inf), compare=True)
    g = result.golden_nonfinite
    assert g is not None and g["golden_tensor"] == "x:0" and g["nonfinite"] == 1
    assert "golden run itself holds nan/inf" in " ".join(result.advice)


def test_nan_or_inf_that_stops_short_of_the_origin_is_said_but_not_made_the_cause(tmp_path):
    """A golden file holds an inf its golden readers never saw (the file of fc1's kernel,
    written over after the run, its index row with it): the golden's own downstream is finite, so the divergence
    at the overflowing Cast does not follow from it. The advice names the inf, and still
    advises the overflow and the repair."""
    import numpy as np
    from precision_tool.analysis import auto_check
    ws = _exp_into_matmul(tmp_path)
    run = ws.run("cpu")
    index = ws.index(run, 0)
    (name,) = index.file[(index.op_name == "fc1/kernel") & (index.io == "output")]
    path = os.path.join(ws.step_path(run, 0), name)
    kernel = np.load(path)
    kernel.flat[0] = np.inf
    np.save(path, kernel)
    recorded_as(ws.step_path(run, 0), name, kernel)     # as a dump of it would record it
    result = auto_check(ws.reopened(), compare=True)
    g = result.golden_nonfinite
    assert g is not None and g["golden_tensor"] == "fc1/kernel:0" and not g["at_origin"]
    assert g["order"] <= result.origin["order"]        # before it, yet not in its way
    advice = " ".join(result.advice)
    assert "golden run itself holds nan/inf" in advice and "follows from it" not in advice
    assert result.advice[0].startswith("The first overflow is Exp/Cast_fp16"), result.advice
    assert "fix -s" in advice


def test_nan_or_inf_the_golden_holds_before_the_divergence_leads_the_advice(tmp_path):
    """The nan is in the data and the golden carries it to where the divergence starts, so
    the advice leads with the data and neither advises scaling the origin's range nor a
    repair. (An inf fed there stops at the tanh, ±1 in both runs: the overflow after it is
    the NPU's own, and is advised as one.)"""
    import math
    from precision_tool.analysis import auto_check
    result = auto_check(_exp_into_matmul(tmp_path, x_value=math.nan), compare=True)
    assert result.golden_nonfinite["order"] <= result.origin["order"]
    assert result.golden_nonfinite["at_origin"]
    assert result.advice[0].startswith("The golden run itself holds nan/inf")
    assert f"starts at {result.origin['op_name']} follows from it" in result.advice[0]
    assert not any("fix -s" in a or "Normalise" in a for a in result.advice), result.advice
    # the op where it starts is not headlined as the root cause
    assert result.origin_title.startswith("Where the divergence starts (from the nan/inf")
    assert result.to_dict()["origin_title"] == result.origin_title


def _step_file(root, target, step, prefix):
    """The one dump file of a step whose name starts with prefix."""
    import glob
    hits = [p for p in glob.glob(os.path.join(root, target, "debug_0", "dump", "**", str(step), "*"),
                                 recursive=True) if os.path.basename(p).startswith(prefix)]
    assert len(hits) == 1, hits
    return hits[0]


@pytest.mark.parametrize("damage", ["reader_missing", "golden_inf"])
def test_the_key_bias_without_its_absorbing_reader_is_carried_noise(workspaces, tmp_path,
                                                                     damage):
    """The healthy Transformer at step 5 with the key projection (which absorbs the key
    bias's drift) unseen: its file deleted, or its golden holding an inf (a pass over the
    finite elements is no evidence). The key bias then cannot be shown without effect, but
    it was written by Adam from a noise gradient in step 0: carried noise, no finding. A
    deleted file and an inf written into a file after the dump (not what its index
    recorded: damage) both make the compare incomplete (exit 2)."""
    import shutil
    import numpy as np
    root = str(tmp_path / "precision_data")
    shutil.copytree(workspaces("healthy_transformer_30"), root)
    if damage == "reader_missing":
        os.remove(_step_file(root, "npu", 5, "MatMulV2.encoder_layer_0_attention_key_BiasAdd."))
    else:
        path = _step_file(root, "cpu", 5, "encoder_layer_0_attention_key_BiasAdd.")
        value = np.load(path, allow_pickle=False).copy()
        value.flat[3] = np.inf
        np.save(path, value)
    runner = CliRunner()
    r = runner.invoke(cli, ["--data-dir", root, "--json", "--log-level", "4", "ac", "-c", "-s", "5"])
    result = json.loads(r.stdout)
    assert result["carried"]["writers_noise"] is True
    assert result["carried"]["variables"] == ["encoder/layer_0/attention/key/bias:0"]
    assert result["diverging_count"] == 0 and result["origin"] is None
    advice = " ".join(result["advice"])
    assert "from rounding noise (a gradient that is zero up to rounding" in advice
    assert "precision-tool fix" not in advice
    assert r.exit_code == 2 and result["verdict"] == "incomplete"
    assert "golden run itself holds nan/inf" not in advice


HEALTHY = [name for name in SCENARIOS if name.startswith("healthy_")]


@pytest.mark.parametrize("name", HEALTHY)
def test_a_healthy_run_is_healthy_to_every_command(workspaces, name):
    """The shipped models trained 30 steps, every step dumped: the summary, the fusion-off
    replay and the repair of the last step all say nothing is wrong (exit 0), and fix says
    so without replaying anything."""
    root = workspaces(name)
    runner = CliRunner()

    def run(*args):
        return runner.invoke(cli, ["--data-dir", root, "--log-level", "4", *args])
    assert run("vc", "-s", "29").exit_code == 0
    assert run("vcs", "-c", "0.98").exit_code == 0
    assert run("fo", "-s", "29").exit_code == 0
    fix = runner.invoke(cli, ["--data-dir", root, "--json", "--log-level", "4", "fix", "-s", "29",
                              "--dry-run"])
    assert fix.exit_code == 0, fix.output
    data = json.loads(fix.stdout)
    assert data["needed"] is False and data["healthy"] is True and data["replays"] == 0


def test_no_advice_to_keep_in_fp32_what_the_mode_computes_in_fp32(tmp_path):
    """A LayerNorm fed values near 1e4 under force_fp32: the fused kernel's one-pass variance
    cancels in fp32 itself (E[x^2] ~ 1e8, its ulp 8, the variance 1). The advice names the
    fusion pass; keeping LayerNorm 'in fp32' would change nothing and is not offered."""
    import numpy as np
    from scenarios import layer_norm_step
    xv = (1e4 + np.random.default_rng(1).normal(size=(32, 64))).astype(np.float32)
    yv = np.random.default_rng(2).integers(0, 10, 32).astype(np.int32)
    root = str(tmp_path)
    layer_norm_step(root, xv, yv, "force_fp32")
    r = CliRunner().invoke(cli, ["--data-dir", root, "--json", "--log-level", "4", "ac", "-c"])
    result = json.loads(r.stdout)
    assert r.exit_code == 1 and result["origin"]["op_name"] == "norm/Add_1"
    advice = " ".join(result["advice"])
    assert "LayerNormFusionPass off" in advice and "already computes in float32" in advice
    assert "keep LayerNorm in fp32" not in advice and "modify_mixlist" not in advice


def _ac(root, *args):
    r = CliRunner().invoke(cli, ["--data-dir", root, "--json", "--log-level", "4", "ac", "-c",
                                 *args])
    return r.exit_code, json.loads(r.stdout)


def test_each_suggested_change_says_what_a_replay_of_the_step_showed(workspaces):
    """ac replays the step under each configuration change its advice offers: the fused
    softmax's two remedies both make the step match (verified); under force_fp16 neither
    the softmax pass off nor SoftmaxV2 in fp32 helps (the LayerNorm after it overflows too),
    so the line leads with what was not replayed and says why the others do not help."""
    code, result = _ac(workspaces("softmax_overflow"))
    said = {d["changes"]: d["verdict"] for d in result["remedies"]}
    assert said == {"fusion pass SoftmaxFusionPass off": "verified",
                    "SoftmaxV2 in fp32": "verified"}
    line = next(a for a in result["advice"] if a.startswith("The first overflow"))
    assert line.count("(verified: a replay of step 0 with it matches the golden)") == 2
    assert "normalise what feeds it (not verified)" in line

    code, result = _ac(workspaces("layernorm_fp16"))
    assert {d["verdict"] for d in result["remedies"]} == {"does not help"}
    line = next(a for a in result["advice"] if a.startswith("The first overflow"))
    tail = line.split("fused by SoftmaxFusionPass (precision-tool fo confirms it): ")[1]
    assert tail.startswith("normalise what feeds it (not verified)")
    assert "switch SoftmaxFusionPass off in fusion_switch.cfg (does not help: a replay of " \
           "step 0 with it still overflows" in tail

    # asked not to replay, every change says so
    code, result = _ac(workspaces("softmax_overflow"), "--no-verify")
    assert result["remedies"] == [] and "(verified" not in " ".join(result["advice"])
    assert "switch SoftmaxFusionPass off in fusion_switch.cfg (not verified)" in result["advice"][0]


def test_a_loss_scale_on_a_graph_without_one_is_not_verified(workspaces):
    code, result = _ac(workspaces("underflow_fp16"))
    assert result["remedies"] == []
    assert "DynamicLossScaleManager(init_loss_scale=16384)) (not verified)" in " ".join(result["advice"])


def test_the_verified_remedies_really_fix_the_step(workspaces):
    """What ac calls verified is what fix's own replay judge passes; what does not help
    fails it (the same StepReplay, independent of the advice text)."""
    from precision_tool.analysis.replays import repair as rp
    from precision_tool.dump import Workspace
    for name in ("softmax_overflow", "layernorm_fp16"):
        root = workspaces(name)
        ws = Workspace(root)
        code, result = _ac(root)
        replay = rp.StepReplay(rp.load_bundle(ws.bundle_path(ws.run("npu"), 0)), "float32",
                               rp.Criteria())
        changes = {c.describe(): c for c in rp.candidate_changes(replay)}
        for d in result["remedies"]:
            passed = replay.run([changes[x] for x in d["changes"].split("; ")]).passed
            assert passed == (d["verdict"] == "verified"), (name, d)


def test_options_lead_with_what_helps_and_never_with_what_does_not():
    """The ordering itself, on made-up replay results: verified, then not replayed, then
    what a replay shows does not help; each tagged."""
    from types import SimpleNamespace
    from precision_tool.analysis.advice import Options
    from precision_tool.analysis.replays.remedy import Change
    r = SimpleNamespace(step=3, remedies=[
        {"changes": "fusion pass P off", "verdict": "does not help",
         "evidence": "leaves the loss non-finite"},
        {"changes": "Exp in fp32", "verdict": "verified", "evidence": "matches the golden"}])
    opts = Options(r)
    text = opts.either(opts.tag("switch P off", [Change("fusion", "P")]),
                       opts.tag("scale it down"),
                       opts.tag("keep Exp in fp32", [Change("fp32", "Exp")]))
    assert text == ("keep Exp in fp32 (verified: a replay of step 3 with it matches the golden), "
                    "or scale it down (not verified), or switch P off (does not help: a replay "
                    "of step 3 with it leaves the loss non-finite)")
    assert opts.asked == [(Change("fusion", "P"),), (Change("fp32", "Exp"),)]


def test_a_lines_only_remedy_that_a_replay_refutes_is_said_as_refuted():
    """A line with one option cannot put a better one first: a refuted one is said as such."""
    from types import SimpleNamespace
    from precision_tool.analysis.advice import Options
    from precision_tool.analysis.replays.remedy import Change
    r = SimpleNamespace(step=0, remedies=[{"changes": "Exp in fp32", "verdict": "does not help",
                                           "evidence": "still overflows"}])
    opts = Options(r)
    refuted = opts.only(opts.tag("keep Exp in fp32", [Change("fp32", "Exp")]))
    assert refuted == ("Not this, a replay shows: keep Exp in fp32 (does not help: a replay of "
                       "step 0 with it still overflows)")
    assert opts.only(opts.tag("scale it")) == "Scale it (not verified)"
