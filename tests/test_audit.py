"""`gradleak audit`: the verdict follows from the stages, a rerun resumes, the budget skips
stages and says so, --fail-if sets the exit status, and report.html renders in Chromium with
nothing cut off and hostile capture strings escaped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest
from helpers import (
    CHROMIUM,
    SHORT_AUDIT,
    TINY,
    as_flags,
    render_in_chromium,
    screenshot_size,
)

from gradleak.cli import main
from gradleak.errors import ConfigError
from gradleak.evaluation.verdict import condition_holds, parse_condition

HOSTILE = "<script>alert('x')</script>&\"'"
HOSTILE_FILE = "<img src=x onerror=alert(1)>.h5"  # a file name holds no slash
DEFENSES = "quant:4;dpsgd:eps=1;agg:2"
FAST = [*as_flags(SHORT_AUDIT), "--max-windows", "3", "--training-free-windows", "1",
        "--optimisation-windows", "1"]


def audit_argv(capture: Path, attackers: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["audit", "--capture", str(capture), "--attacker", f"TRACE={attackers['trace']}",
            "--attacker", f"LtI={attackers['lti']}", "--defenses", DEFENSES, "--out", str(out),
            *FAST, *extra]


@pytest.fixture(scope="module")
def hostile_capture(random_capture: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The held-out capture under a hostile file name, with a hostile scene name inside."""
    copy = tmp_path_factory.mktemp("hostile") / HOSTILE_FILE
    shutil.copy(random_capture, copy)
    with h5py.File(copy, "r+") as file:
        key = "all_scenes" if "all_scenes" in file.attrs else "scenes"
        scenes = json.loads(file.attrs[key])
        file.attrs[key] = json.dumps([HOSTILE, *scenes[1:]])
    return copy


@pytest.fixture(scope="module")
def audited(hostile_capture: Path, trained_attackers, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("audit") / "run"
    attackers = {**trained_attackers}
    argv = audit_argv(hostile_capture, attackers, out, "--json")
    argv[argv.index(f"TRACE={attackers['trace']}")] = f"{HOSTILE}={attackers['trace']}"
    from contextlib import redirect_stdout
    from io import StringIO

    printed = StringIO()
    with redirect_stdout(printed):
        assert main(argv) == 0
    return out, json.loads(printed.getvalue())


@pytest.mark.slow
def test_the_verdict_follows_from_the_stages(audited) -> None:
    out, verdict = audited
    summary = json.loads((out / "results.json").read_text())
    assert verdict["actions"]["accuracy"] == max(
        r["accuracy"] for r in summary["stages"]["actions"]["result"].values()
        if not r["oracle_advantage_sign"])
    closed = summary["stages"]["closed form"]["result"]
    assert verdict["closed_form"]["advantages"] == closed["advantage_exact_fraction"] == 1.0
    clean = summary["stages"]["defense none"]["result"]["methods"]
    frames = {n: r for n, r in clean.items() if r["kind"] != "reference" and "psnr" in r}
    assert verdict["frames"]["psnr"] == max(r["psnr"] for r in frames.values())
    assert {"DLG", "IG", "training-free", HOSTILE, "LtI"} <= set(frames)
    # DLG and IG run last, in their own stage, so they never take the defense stages' budget;
    # their rows join the clean stage's in results.json
    assert list(summary["stages"])[-1] == "optimisation baselines"
    saved = json.loads((out / "stages" / "defense-none.json").read_text())["result"]["methods"]
    assert "IG" not in saved and "training-free" in saved
    outcomes = {o["spec"]: o for o in verdict["defenses"]}
    assert list(outcomes) == DEFENSES.split(";")
    assert outcomes["dpsgd:eps=1"]["epsilon"] == pytest.approx(1.0, abs=0.05)
    # DLG and IG only on the clean stream; aggregation leaves only the learned attackers
    defended = summary["stages"]["defense quant:4"]["result"]["methods"]
    assert "IG" not in defended and "training-free" in defended
    # under each single-step defense the defense-aware attack runs beside the blind one, on
    # the same frames; it is no row of the clean stream (there it is the exact attack)
    assert defended["training-free (defense-aware)"]["frames"] == defended["training-free"][
        "frames"]
    assert "training-free (defense-aware)" in summary["stages"]["defense dpsgd:eps=1"]["result"][
        "methods"] and "training-free (defense-aware)" not in clean
    # each learned attacker has its control, fed other steps' gradients
    assert clean["LtI on other steps' gradients (control)"]["kind"] == "control"
    assert "training-free" not in summary["stages"]["defense agg:2"]["result"]["methods"]
    stopping = [o for o in outcomes.values() if o["stops"]]
    assert verdict["weakest_stopping"] == (max(stopping, key=lambda o: o["cosine"])["spec"]
                                           if stopping else None)
    for o in outcomes.values():  # "stops" means every attack at the mean image, actions at chance
        gains = [a["psnr_gain_over_mean_image"] for a in o["per_attack"].values()
                 if a["psnr_gain_over_mean_image"] is not None]
        if o["stops"]:
            assert max(gains) <= verdict["stop_margin_db"]
    assert verdict["headline"][0].startswith("Actions:") and verdict["report"].endswith(".html")


def test_a_rerun_resumes_and_other_settings_are_refused(audited, hostile_capture: Path,
                                                        trained_attackers, capsys) -> None:
    out, _ = audited
    stages = sorted((out / "stages").iterdir())
    before = {p.name: p.stat().st_mtime_ns for p in stages}
    argv = audit_argv(hostile_capture, trained_attackers, out, "--quiet")
    argv[argv.index(f"TRACE={trained_attackers['trace']}")] = \
        f"{HOSTILE}={trained_attackers['trace']}"
    assert main([*argv, "--budget-minutes", "50"]) == 0  # the budget may change
    assert {p.name: p.stat().st_mtime_ns for p in (out / "stages").iterdir()} == before
    capsys.readouterr()
    assert main([*argv[:-1], "--training-free-windows", "2", "--quiet"]) == 2
    assert "other settings (training_free_windows)" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in (out / "stages").iterdir()} == before


def test_a_foreign_folder_is_refused_untouched(random_capture: Path, trained_attackers,
                                               tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(audit_argv(random_capture, trained_attackers, tmp_path, "--quiet")) == 2
    assert "holds no audit.json" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_a_small_budget_skips_the_defenses_and_says_so(random_capture: Path, trained_attackers,
                                                       tmp_path: Path, capsys,
                                                       clock: str) -> None:
    assert main(audit_argv(random_capture, trained_attackers, tmp_path / "a", "--json",
                           "--budget-minutes", "1e-6", "--optimisation", "",
                           "--clock", clock)) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert set(verdict["skipped"]) == {f"defense {s}" for s in DEFENSES.split(";")}
    assert all(o["skipped"].startswith("budget") for o in verdict["defenses"])
    assert any("Not run within the budget" in line for line in verdict["headline"])


def test_fail_if_sets_the_exit_status(audited, hostile_capture: Path, trained_attackers,
                                      capsys) -> None:
    out, verdict = audited
    argv = audit_argv(hostile_capture, trained_attackers, out, "--quiet")
    argv[argv.index(f"TRACE={trained_attackers['trace']}")] = \
        f"{HOSTILE}={trained_attackers['trace']}"
    psnr = verdict["frames"]["psnr"]
    assert main([*argv, "--fail-if", f"psnr>{psnr - 1} and actions>=0"]) == 1
    assert "--fail-if" in capsys.readouterr().err
    assert main([*argv, "--fail-if", f"psnr>{psnr + 1}"]) == 0


@pytest.mark.parametrize(("extra", "message"), [
    (["--fail-if", "psnr >> 3"], "cannot read 'psnr >> 3'"),
    (["--fail-if", ""], "--fail-if '': cannot read ''"),
    (["--defenses", "quant:99"], "quant"),
    (["--budget-minutes", "0"], "--budget-minutes 0"),
    (["--set", "attack.ig.iterations=many"], "attack.ig.iterations"),
    (["--set", "attack.training_free.solve.iterations=-5"],
     "--set field attack.training_free.solve.iterations=-5: expected at least 1"),
    (["--seed", "-1"], "--seed -1"),
])
def test_bad_arguments_are_refused_before_any_work(random_capture: Path, trained_attackers,
                                                   tmp_path: Path, capsys, extra: list[str],
                                                   message: str) -> None:
    out = tmp_path / "never"
    assert main([*audit_argv(random_capture, trained_attackers, out), *extra]) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.slow
def test_the_minimal_audit_runs_the_default_grid_on_what_was_given(random_capture: Path,
                                                                    tmp_path: Path,
                                                                    capsys) -> None:
    """`audit --capture FILE --out DIR` alone: the default grid's aggregate needs a learned
    attacker, so it is left out and named, and every other stage runs or is budgeted."""
    assert main(["audit", "--capture", str(random_capture), "--out", str(tmp_path / "a"),
                 *FAST, "--budget-minutes", "0.01", "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["skipped"]["defense agg:8"].startswith("needs a learned attacker")
    assert any(line.startswith("Not run: defense agg:8 (needs a learned attacker")
               for line in verdict["headline"])
    assert "defense agg:8" not in next(line for line in verdict["headline"]
                                       if line.startswith("Not run within the budget"))


def test_aggregation_without_a_learned_attacker_is_refused_up_front(random_capture: Path,
                                                                    tmp_path: Path,
                                                                    capsys) -> None:
    assert main(["audit", "--capture", str(random_capture), "--defenses", "quant:8;agg:4",
                 "--out", str(tmp_path / "a")]) == 2
    assert "agg:4: it aggregates steps" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_a_rerun_on_other_data_at_the_same_path_reuses_nothing(random_capture: Path,
                                                                float16_capture: Path,
                                                                tmp_path: Path, capsys) -> None:
    """Stages belong to the capture's content: replaced at its path by another capture, the
    audit is refused rather than served the old stages."""
    path = tmp_path / "heldout.h5"
    shutil.copyfile(random_capture, path)
    argv = ["audit", "--capture", str(path), "--defenses", "none", "--out",
            str(tmp_path / "audit"), *FAST, "--optimisation-windows", "0", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["frames"]["method"]
    assert main(argv) == 0  # the same data: every stage read back
    shutil.copyfile(float16_capture, path)  # other data, same path, same θ0 and rows
    stages = sorted((tmp_path / "audit" / "stages").iterdir())
    before = [p.read_bytes() for p in stages]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds an audit of other data at the same path" in err and "50 rows" in err
    assert [p.read_bytes() for p in stages] == before


@pytest.mark.parametrize("damage, fragment", [
    ({"methods": "oops"}, "'methods' is not an object of method rows"),
    (None, "'result' is NoneType"),
])
@pytest.mark.slow
def test_a_damaged_stage_file_is_named_not_a_traceback(random_capture: Path, tmp_path: Path,
                                                       capsys, damage, fragment) -> None:
    argv = ["audit", "--capture", str(random_capture), "--defenses", "none", "--out",
            str(tmp_path / "audit"), *FAST, "--optimisation-windows", "0", "--quiet"]
    assert main(argv) == 0
    path = tmp_path / "audit" / "stages" / "defense-none.json"
    saved = json.loads(path.read_text())
    saved["result"] = damage if damage is None else {**saved["result"], **damage}
    path.write_text(json.dumps(saved))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"audit stage file {path}: {fragment}" in err and "Traceback" not in err


@pytest.mark.slow
def test_two_audits_of_one_folder_never_run_together(random_capture: Path, tmp_path: Path,
                                                     capsys) -> None:
    from gradleak.auditing import LOCK
    from gradleak.io import exclusive

    out = tmp_path / "audit"
    argv = ["audit", "--capture", str(random_capture), "--defenses", "none", "--out", str(out),
            *FAST, "--optimisation-windows", "0", "--quiet"]
    out.mkdir()
    with exclusive(out / LOCK, RuntimeError):  # an audit of this folder, running elsewhere
        assert main(argv) == 2
        assert "is being written by another audit (PID" in capsys.readouterr().err
        assert [p.name for p in out.iterdir()] == [LOCK]  # nothing written beside its lock
    assert main(argv) == 0  # once it is done, the folder is free
    assert not (out / LOCK).exists()


def test_fail_if_grammar_and_binds_tighter_than_or() -> None:
    verdict = {"frames": {"psnr": 30.0, "ssim": 0.5}, "actions": {"accuracy": 0.2}}
    assert condition_holds(parse_condition("psnr>25 and actions>0.5 or ssim>=0.5"), verdict)[0]
    assert not condition_holds(parse_condition("psnr>25 and actions>0.5"), verdict)[0]
    held, clauses = condition_holds(parse_condition("returns>0.5 and psnr<=30"), verdict)
    assert held and "returns > 0.5: not measured, so not cleared" in clauses and \
        "psnr 30 <= 30" in clauses
    # a metric the audit could not measure never passes the gate, whatever the threshold
    for unmeasured in ("advantages>0.5 or returns>0.5", "lpips<0", "returns>1e9 and psnr>0"):
        held, clauses = condition_holds(parse_condition(unmeasured), verdict)
        assert held and any("not measured" in clause for clause in clauses), unmeasured
    assert not condition_holds(parse_condition("returns>0.5 and psnr>31"), verdict)[0]
    for bad in ("", " ", "psnr>", "rm -rf > 3", "psnr > 3 xor ssim > 1", "__import__('os')>1"):
        with pytest.raises(ConfigError, match="--fail-if"):
            parse_condition(bad)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run "
                    "installs it)")
def test_the_report_renders_whole_in_chromium_with_hostile_strings_escaped(
        audited, tmp_path: Path) -> None:
    out, _ = audited
    report = out / "report.html"
    text = report.read_text()
    assert "http://" not in text and "https://" not in text
    assert HOSTILE not in text and "&lt;script&gt;alert(" in text
    assert "<img src=x" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text
    assert text.index("Verdict") < text.index("<figure")  # the verdict comes first
    attrs, dom = render_in_chromium(report, tmp_path)
    assert int(attrs["tables"]) == text.count("<table>") >= 6
    # the clean frames, DLG's and IG's, the privacy–utility plot, PSNR by t, and each
    # defense's frames
    pictures = 4 + len(DEFENSES.split(";"))
    assert int(attrs["images"]) == pictures and attrs["images-loaded"] == attrs["images"]
    assert attrs["cut-off"] == "0"  # nothing reaches past the right edge at desktop width
    # the strings stayed text: no element came of them
    assert "<script>alert" not in dom and "<img src=\"x\"" not in dom
    assert screenshot_size(report, tmp_path) > 20_000  # a rendered page, not a blank one


@pytest.mark.slow
def test_with_a_training_capture_the_audit_trains_its_own_attackers(
        random_capture: Path, train_capture: Path, tmp_path: Path, capsys) -> None:
    attack = [a for pair in zip(TINY[::2], TINY[1::2], strict=True) if pair[1].startswith(
        "attack.") for a in pair]
    out = tmp_path / "own"
    assert main(["audit", "--capture", str(random_capture), "--train", str(train_capture),
                 "--defenses", "none", "--optimisation", "", "--out", str(out), "--json",
                 "--max-windows", "2", "--training-free-windows", "1", *attack]) == 0
    verdict = json.loads(capsys.readouterr().out)
    summary = json.loads((out / "results.json").read_text())
    trained = summary["stages"]["attackers"]["result"]
    assert set(trained) == {"TRACE", "LtI"}
    assert all((Path(folder) / "attacker.safetensors").is_file() for folder in trained.values())
    clean = summary["stages"]["defense none"]["result"]
    assert {"TRACE", "LtI", "training-free"} <= set(clean["methods"])
    assert str(train_capture) in clean["mean_image_source"] and verdict["defenses"] == []
    assert json.loads((out / "preset.json").read_text())["attack"]["trace"]["window"] == 4


@pytest.mark.slow
def test_without_attackers_the_reference_is_the_held_out_frames(random_capture: Path,
                                                                tmp_path: Path,
                                                                capsys) -> None:
    assert main(["audit", "--capture", str(random_capture), "--defenses", "noise:0.01",
                 "--optimisation", "", "--training-free-windows", "1", "--out", str(tmp_path / "a"),
                 "--json", *as_flags(SHORT_AUDIT)]) == 0
    verdict = json.loads(capsys.readouterr().out)
    clean = json.loads((tmp_path / "a" / "results.json").read_text())["stages"][
        "defense none"]["result"]
    assert set(clean["methods"]) >= {"training-free", "mean training image"}
    assert str(random_capture) in clean["mean_image_source"]
    assert verdict["frames"]["method"] == "training-free"
    assert verdict["frames"]["gain"] > 3  # the float32 stream gives frames away, untrained
    assert clean["mean_image_of"] == "audited frames"  # and the verdict names it so
    assert "mean of the audited frames" in verdict["reference"]
    assert any("against the mean of the audited frames" in line for line in verdict["headline"])


def audit_of(victim: str, tmp_path: Path, capsys) -> dict:
    """The verdict of an undefended audit (no optimisation baselines) of 16 held-out steps of
    a random-init victim."""
    from conftest import tiny_preset

    from gradleak.capture.run import CaptureJob, run_capture

    capture = tmp_path / f"{victim}.h5"
    run_capture(CaptureJob(victim=victim, random_init=True, split="heldout", steps=16,
                           out=capture, preset=tiny_preset(), progress=False, seed=4))
    assert main(["audit", "--capture", str(capture), "--defenses", "none", "--optimisation",
                 "", "--out", str(tmp_path / "a"), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_an_attack_the_victim_does_not_allow_is_named_not_run(tmp_path: Path,
                                                             capsys) -> None:
    """IMPALA's max-pooling and residual blocks have no route for the training-free attack yet:
    the audit runs the rest and says why that one did not run (each route's reason)."""
    verdict = audit_of("impala-small", tmp_path, capsys)
    reason = verdict["not_applicable"]["training-free"]
    assert "patch embedding: " in reason and "conv stack: " in reason and "maxpool" in reason
    assert any(line.startswith("Not applicable to this victim: training-free") for line in
               verdict["headline"])
    assert verdict["actions"]["accuracy"] >= 0.9 and "frames" not in verdict


@pytest.mark.slow
def test_a_vit_audit_returns_its_frames_training_free(tmp_path: Path, capsys) -> None:
    """A vision transformer's frames come back from its patch embedding's gradient: the
    audit's training-free attack is exact on them (float32 wire) and the verdict says so."""
    verdict = audit_of("vit-tiny-small", tmp_path, capsys)
    assert "training-free" not in (verdict.get("not_applicable") or {})
    assert verdict["frames"]["method"] == "training-free"
    assert verdict["frames"]["psnr"] >= 60.0 and verdict["actions"]["accuracy"] == 1.0


def _summary(attack: dict, skipped: bool = False, control: dict | None = None,
             cosine: float = 0.01) -> dict:
    """A minimal audit summary: one defense stage (dpsgd) holding one frame attack's row, and
    the attacker's control (itself on other steps' gradients) when given."""
    from gradleak.evaluation.scoring import control_name

    reference = {"kind": "reference", "psnr": 22.0, "ssim": 0.49, "lpips": 0.64}
    methods = {"mean training image": reference,
               "mean colour (oracle)": {"kind": "reference", "psnr": 24.0},
               "TRACE": {"kind": "learned", "frames": 256, **attack}}
    if control is not None:
        methods[control_name("TRACE")] = {"kind": "control", "frames": 256,
                                          "action_accuracy": 0.9, **control}
    stage = {"result": None, "skipped": "budget: about 3 min needed, 1 left", "seconds": 0} \
        if skipped else {"skipped": None, "seconds": 1.0, "result": {
            "methods": methods, "utility": {"cosine": cosine, "relative_norm_error": 30.0},
            "defense": {"transforms": [{"name": "dpsgd", "eps": 1.0, "delta": 1e-5, "clip": 1.0,
                                        "q": 1 / 128, "steps": 1000, "sigma": 1.9,
                                        "achieved_eps": 0.99}]}}}
    return {"capture": {"num_actions": 5},
            "stages": {"defense none": {"result": {"methods": methods}, "skipped": None},
                       "defense dpsgd:eps=1": stage}}


@pytest.mark.parametrize(("attack", "stops"), [
    ({"psnr": 22.5, "psnr_gain_over_mean_image": 0.5, "ssim": 0.49, "lpips": 0.33}, False),
    ({"psnr": 22.5, "psnr_gain_over_mean_image": 0.5, "ssim": 0.55, "lpips": 0.64}, False),
    ({"psnr": 22.5, "psnr_gain_over_mean_image": 0.5, "ssim": 0.50, "lpips": None}, False),
    ({"psnr": 22.5, "psnr_gain_over_mean_image": 0.5, "ssim": 0.50, "lpips": 0.63}, True)])
def test_a_defense_stops_an_attack_only_at_the_reference_on_every_metric(attack: dict,
                                                                         stops: bool) -> None:
    from gradleak.evaluation.verdict import verdict

    v = verdict(_summary(attack))
    (outcome,) = v["defenses"]
    assert outcome["stops"] is stops and (v["weakest_stopping"] == "dpsgd:eps=1") is stops
    if not stops:  # the headline names what still leaks
        line = next(line for line in v["headline"] if "not stopped" in line)
        assert "TRACE" in line and ("LPIPS" in line or "SSIM" in line or "not measured" in line)
    else:  # ε comes with what it stands on
        line = next(line for line in v["headline"] if line.startswith("Defense:"))
        assert all(part in line for part in ("σ = 1.9", "C = 1", "q = 0.00781", "1000 steps"))


@pytest.mark.parametrize(("lpips", "stops"), [(0.60, True), (0.55, False)])
def test_a_learned_attackers_own_prior_is_no_leak(lpips: float, stops: bool) -> None:
    """TRACE's sharp typical frame beats the mean image's LPIPS (0.64) with no information:
    set against itself fed other steps' gradients (LPIPS 0.60, actions it reads there do not
    count), it is stopped at 0.60 and not at 0.55."""
    from gradleak.evaluation.verdict import verdict

    attack = {"psnr": 21.8, "psnr_gain_over_mean_image": -0.2, "ssim": 0.48, "lpips": lpips}
    control = {"psnr": 21.7, "psnr_gain_over_mean_image": -0.3, "ssim": 0.47, "lpips": 0.60}
    (outcome,) = verdict(_summary(attack, control=control))["defenses"]
    assert outcome["stops"] is stops
    assert verdict(_summary(attack))["defenses"][0]["stops"] is False  # no control: it leaks


@pytest.mark.parametrize(("accuracy", "stops"), [(0.62, True), (0.85, False)])
def test_actions_a_learned_attacker_reads_are_set_against_its_control(accuracy: float,
                                                                      stops: bool) -> None:
    """Its control predicts 60% of 256 actions (a skewed marginal: chance is 20%); reading
    62% under the defense is that prior, 85% is the gradients."""
    from gradleak.evaluation.verdict import verdict

    attack = {"psnr": 21.8, "psnr_gain_over_mean_image": -0.2, "ssim": 0.48, "lpips": 0.65,
              "action_accuracy": accuracy}
    control = {"psnr": 21.7, "psnr_gain_over_mean_image": -0.3, "ssim": 0.47, "lpips": 0.65,
               "action_accuracy": 0.60}
    (outcome,) = verdict(_summary(attack, control=control))["defenses"]
    assert outcome["stops"] is stops and (outcome["actions_above_chance"] == []) is stops


@pytest.mark.parametrize(("cosine", "unproven"), [(0.01, False), (0.95, True)])
def test_a_defense_that_leaves_the_update_intact_is_never_called_safe(cosine: float,
                                                                      unproven: bool) -> None:
    """Every attack at the reference under a defense whose update keeps cosine 0.95 to the
    clean one: the information is still there, so the verdict says the attacks fell short."""
    from gradleak.evaluation.verdict import verdict

    attack = {"psnr": 22.5, "psnr_gain_over_mean_image": 0.5, "ssim": 0.50, "lpips": 0.63}
    v = verdict(_summary(attack, cosine=cosine))
    assert v["weakest_stopping"] == "dpsgd:eps=1"
    assert (v["unproven"] == ["dpsgd:eps=1"]) is unproven
    assert any(line.startswith("Caution: dpsgd:eps=1 leaves the update at cosine 0.950")
               and "not as safe" in line for line in v["headline"]) is unproven


def test_a_skipped_defense_is_one_the_verdict_cannot_speak_for() -> None:
    from gradleak.evaluation.verdict import verdict

    v = verdict(_summary({"psnr": 22.5, "psnr_gain_over_mean_image": 0.5, "ssim": 0.5},
                         skipped=True))
    assert v["weakest_stopping"] is None
    assert any(line.startswith("The verdict cannot speak for dpsgd:eps=1") for line in
               v["headline"])


@pytest.mark.slow
def test_the_demo_runs_its_defense_stages_on_a_clock_that_says_the_budget_is_spent(
        random_capture: Path, trained_attackers, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from gradleak.auditing import Audit
    from gradleak.demo import DEMO_DEFENSES, audit_config
    from gradleak.presets import load_preset
    from gradleak.training.loop import Budget

    preset = load_preset("cpu-quick", SHORT_AUDIT)
    config = replace(audit_config(random_capture, tmp_path, preset), max_windows=2,
                     training_free_windows=1, optimisation_windows=1,
                     attackers={"TRACE": str(trained_attackers["trace"])})
    monkeypatch.setattr(Budget, "minutes_left", lambda self: -60.0)  # an hour over, always
    summary = Audit(config, progress=False, preset=preset).run()
    assert not summary["verdict"]["skipped"]
    assert [o["spec"] for o in summary["verdict"]["defenses"] if not o.get("skipped")] == \
        DEMO_DEFENSES


@pytest.mark.slow
def test_each_stage_runs_the_single_step_attacks_that_can_read_its_stream(
        random_capture: Path, tmp_path: Path) -> None:
    """The defense-aware attack beside the blind one wherever the stream went through a
    declared defense: a stage's, or the capture's own (`gradleak defend`) on its clean stage;
    where it cannot model the chain, the stage says why; an aggregate runs neither."""
    from gradleak.auditing import Audit, AuditConfig
    from gradleak.defenses import parse_defense
    from gradleak.names import DEFENSE_AWARE, TRAINING_FREE

    defended = tmp_path / "quant12.h5"
    assert main(["defend", str(random_capture), "--out", str(defended), "--defense", "quant:12",
                 "--quiet"]) == 0
    plain = Audit(AuditConfig(capture=str(random_capture), out=str(tmp_path / "a")),
                  progress=False)
    audit = Audit(AuditConfig(capture=str(defended), out=str(tmp_path / "b")), progress=False)

    def run_on(which: Audit, spec: str) -> dict:
        return which.single_step_attacks(parse_defense(spec))[0]

    assert list(run_on(plain, "none")) == [TRAINING_FREE]
    assert set(run_on(plain, "quant:8")) == {TRAINING_FREE, DEFENSE_AWARE}
    assert run_on(plain, "agg:2") == {}
    assert set(run_on(audit, "none")) == {TRAINING_FREE, DEFENSE_AWARE}
    baselines, reasons = audit.single_step_attacks(parse_defense("quant:8"))  # after quant:12
    assert list(baselines) == [TRAINING_FREE] and reasons[DEFENSE_AWARE]
