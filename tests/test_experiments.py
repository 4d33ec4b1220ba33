"""`gradleak experiment`: a grid runs cell by cell, resumes, shards and merges; settings and
folders are checked before any cell runs."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pytest

from gradleak.cli import main

PLUGIN = ["--plugin", "user_experiments"]


def ran(out) -> list[str]:
    return (out / "ran.log").read_text().split() if (out / "ran.log").exists() else []


def test_a_grid_runs_resumes_and_merges_with_mean_and_std(tmp_path, capsys) -> None:
    out, results = tmp_path / "toy", tmp_path / "results"
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--budget-minutes", "0.5",
                 "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["ran"]) == 6 and summary["missing_in_grid"] == []
    assert len(ran(out)) == 6 and len(list((out / "shared").glob("*/table.json"))) == 1
    # a second run without --resume is refused; with it, nothing is redone
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--budget-minutes", "0.5",
                 "--out", str(out)]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--budget-minutes", "0.5",
                 "--out", str(out), "--resume", "--quiet"]) == 0
    assert len(ran(out)) == 6
    assert main(["experiment", "toy", *PLUGIN, "--merge", "--out", str(out), "--results",
                 str(results), "--quiet"]) == 0
    merged = json.loads((results / "toy.json").read_text())
    assert merged["summary"] == {"a": 0.5, "b": 10.5, "c": 20.5}
    assert merged["settings"]["budget_minutes"] == 0.5 and len(merged["cells"]) == 6
    assert all(c["result"]["budget"] == 0.5 for c in merged["cells"])
    # the shared table's 0.3 CPU-seconds are counted once, apart from the cell that built it
    builder = max(merged["cells"], key=lambda c: c["shared_cpu_minutes"])
    assert builder["shared_cpu_minutes"] >= 0.3 / 60 > builder["cpu_minutes"]
    assert merged["shared_cpu_minutes"] == builder["shared_cpu_minutes"]
    assert "| b | 10.50 ± 0.50 |" in (results / "toy.md").read_text()
    assert len(merged["victim_checkpoints"]["victim"]) == 1
    assert "different checkpoints" not in (results / "toy.md").read_text()


def test_shards_split_the_grid_and_merge_refuses_what_is_missing(tmp_path, capsys) -> None:
    out, results = tmp_path / "toy", tmp_path / "results"
    run = ["experiment", "toy", *PLUGIN, "--seeds", "2", "--out", str(out), "--quiet"]
    assert main([*run, "--shard", "0/2"]) == 0
    first = ran(out)
    assert len(first) == 3
    assert main(["experiment", "toy", *PLUGIN, "--merge", "--out", str(out), "--results",
                 str(results)]) == 2
    assert "3 of 6 cells have not run" in capsys.readouterr().err
    assert not results.exists()
    assert main(["experiment", "toy", *PLUGIN, "--merge", "--allow-partial", "--out",
                 str(out), "--results", str(results), "--quiet"]) == 0
    assert len(json.loads((results / "toy.json").read_text())["missing"]) == 3
    assert main([*run, "--shard", "1/2", "--resume"]) == 0
    assert sorted(ran(out)) == sorted(set(ran(out))) and len(ran(out)) == 6  # disjoint


def test_a_slice_of_the_grid_runs_first_split_by_the_shards(tmp_path, capsys) -> None:
    out = tmp_path / "toy"
    run = ["experiment", "toy", *PLUGIN, "--seeds", "2", "--out", str(out), "--quiet"]
    assert main([*run, "--where", "setting=b,c", "--where", "seed=1", "--shard", "0/2"]) == 0
    assert main([*run, "--where", "setting=b,c", "--where", "seed=1", "--shard", "1/2",
                 "--resume"]) == 0
    assert sorted(ran(out)) == ["setting=b,seed=1", "setting=c,seed=1"]
    assert main([*run, "--resume"]) == 0  # the rest of the grid, later, into the same folder
    assert len(ran(out)) == 6 and len(set(ran(out))) == 6
    for where, named in (("size=b", "the axes are setting, seed"),
                         ("setting=d", "from a, b, c"), ("seed=", "from 0, 1")):
        assert main([*run, "--resume", "--where", where]) == 2
        assert named in capsys.readouterr().err
    assert len(ran(out)) == 6


def half_a_grid_merged(tmp_path: Path) -> tuple[Path, Path]:
    """An earlier session's run folder with half the toy grid, and its partial merge's folder."""
    first, results = tmp_path / "first", tmp_path / "results"
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--quiet", "--out", str(first),
                 "--shard", "0/2"]) == 0
    assert main(["experiment", "toy", *PLUGIN, "--merge", "--allow-partial", "--out",
                 str(first), "--results", str(results), "--quiet"]) == 0
    return first, results


def test_a_later_session_continues_a_merged_partial_grid(tmp_path, capsys) -> None:
    """The run folder is gone (a new machine); the merged partial result is all that is left:
    --import-cells takes its cells, runs only the others, and the merge says which came from
    where. Another grid's or other settings' result is refused."""
    _, results = half_a_grid_merged(tmp_path)
    merged = results / "toy.json"
    later = tmp_path / "later"
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--out", str(later),
                 "--import-cells", str(merged), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["imported"]) == 3 and len(summary["ran"]) == 3
    assert summary["missing_in_grid"] == [] and not set(summary["imported"]) & set(summary["ran"])
    assert len(ran(later)) == 3  # the imported cells did not run again
    assert main(["experiment", "toy", *PLUGIN, "--merge", "--out", str(later), "--results",
                 str(results), "--quiet"]) == 0
    table = (results / "toy.md").read_text()
    assert "3 of the 6 cells were run by an earlier session" in table
    assert "the others ran on victims rebuilt" in table
    # each session trained its own victim: the merge says the rows mix two checkpoints
    assert "attacked 2 different checkpoints" in table
    assert len(json.loads(merged.read_text())["victim_checkpoints"]["victim"]) == 2
    capsys.readouterr()
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--budget-minutes", "9",
                 "--out", str(tmp_path / "other"), "--import-cells", str(merged)]) == 2
    assert "other settings (budget_minutes" in capsys.readouterr().err
    assert main(["experiment", "components", "--seeds", "2", "--out", str(tmp_path / "one"),
                 "--import-cells", str(merged)]) == 2
    assert "not a merged result of experiment 'components'" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--out", str(tmp_path / "bad"),
                 "--import-cells", str(merged), "--shard", "2/2"]) == 2  # checked first
    assert "--shard '2/2'" in capsys.readouterr().err
    for name in ("other", "one", "bad"):
        assert not (tmp_path / name).exists()


def test_cells_rerun_on_the_earlier_sessions_victims_are_said_to_be(tmp_path, capsys) -> None:
    """A later session that kept the earlier one's shared folder (--shared) attacks the very
    checkpoints the imported cells did: the merge says so instead of 'rebuilt'."""
    first, results = half_a_grid_merged(tmp_path)
    later = tmp_path / "later"
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--quiet", "--out", str(later),
                 "--shared", str(first / "shared"),
                 "--import-cells", str(results / "toy.json")]) == 0
    assert len(ran(later)) == 3
    assert main(["experiment", "toy", *PLUGIN, "--merge", "--out", str(later), "--results",
                 str(results), "--quiet"]) == 0
    table = (results / "toy.md").read_text()
    assert "the others ran here on the same checkpoints" in table
    assert "rebuilt" not in table and "different checkpoints" not in table


def test_settings_and_folders_are_checked_before_any_cell(tmp_path, capsys) -> None:
    out = tmp_path / "toy"
    base = ["experiment", "toy", *PLUGIN, "--out", str(out)]
    assert main([*base, "--seeds", "1", "--quiet"]) == 0
    assert main([*base, "--seeds", "3", "--resume"]) == 2
    assert "seeds: 1 → 3" in capsys.readouterr().err
    for flags, message in ((["--shard", "2/2"], "--shard '2/2'"),
                           (["--seeds", "0"], "--seeds 0"),
                           (["--budget-minutes", "0"], "--budget-minutes 0")):
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
    assert main(["experiment", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown experiment 'nope'" in capsys.readouterr().err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["experiment", "toy", *PLUGIN, "--out", str(mine)]) == 2
    assert "not an experiment run" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_components_and_losses_share_a_victim_and_measure_what_they_say(tmp_path) -> None:
    """Real cells on the tiny preset: the heads-only capture is smaller than the full one, and
    a CNN-only one (no policy head for the action rule) is still scored;
    `losses` without LPIPS trains with its weight at 0; both experiments, given one --shared
    root, train the victim once and reuse the full capture."""
    from helpers import TINY

    from gradleak.capture.reader import CaptureFile

    shared, results = tmp_path / "shared", tmp_path / "results"
    tiny = ["--seeds", "1", "--budget-minutes", "0.05", *TINY, "--set",
            "capture.steps_train=48", "--set", "capture.steps_heldout=24", "--shared",
            str(shared), "--quiet"]
    components = ["experiment", "components", *tiny, "--out", str(tmp_path / "components")]
    assert main([*components, "--shard", "0/8"]) == 0  # ppo, all gradients
    assert main([*components, "--shard", "3/8", "--resume"]) == 0  # ppo, heads only
    # CNN only: no policy-head gradient for the action rule; TRACE still predicts actions
    assert main([*components, "--shard", "1/8", "--resume"]) == 0
    (key,) = shared.iterdir()  # one preset key
    with CaptureFile(key / "capture-ppo-all-heldout.h5") as full, \
            CaptureFile(key / "capture-ppo-heads-heldout.h5") as heads:
        full_dim, heads_dim = full.attrs["gradient_dim"], heads.attrs["gradient_dim"]
        assert heads.attrs["restricted_from"] == str(full.path)  # cut, not recorded again
    assert heads_dim < full_dim
    built = {p.name: p.stat().st_mtime_ns for p in key.iterdir()}
    losses = tmp_path / "losses"
    assert main(["experiment", "losses", *tiny, "--out", str(losses), "--shard", "4/12"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in key.iterdir()} == built  # nothing rebuilt
    (cell,) = (losses / "cells").iterdir()
    record = json.loads(cell.read_text())
    assert record["cell"]["without"] == "lpips" and record["result"]["weights"]["perceptual"] == 0
    assert record["result"]["weights"]["mse"] == 1.0 and record["result"]["attack"]["psnr"] > 0
    assert main(["experiment", "components", "--merge", "--allow-partial", "--out",
                 str(tmp_path / "components"), "--results", str(results), "--quiet"]) == 0
    merged = json.loads((results / "components.json").read_text())
    cells = {c["cell"]["components"]: c["result"] for c in merged["cells"]}
    assert set(cells) == {"all", "cnn", "heads"} and len(merged["missing"]) == 5
    assert 0 <= cells["cnn"]["attack"]["action_accuracy"] <= 1
    assert cells["heads"]["gradient_dim"] == heads_dim
    assert cells["all"]["mean training image"]["psnr"] > 0
    table = (results / "components.md").read_text()
    assert "| ppo | heads |" in table
    # the attacker's size and speed, from the cell's own record
    size = f"| {cells['heads']['attack']['parameters']:,} | " \
        f"{cells['heads']['attack']['ms_per_frame']:.2f} |"
    assert size in table.split("| ppo | heads |")[1].split("\n")[0]


@pytest.mark.slow
def test_context_under_noise_trains_adaptive_attackers_and_says_whether_t8_beats_t1(
        tmp_path) -> None:
    from helpers import TINY

    out, results = tmp_path / "context", tmp_path / "results"
    run = ["experiment", "context", "--seeds", "1", "--budget-minutes", "0.05", *TINY,
           "--set", "capture.steps_train=160", "--set", "capture.steps_heldout=60",
           "--set", "attack.trace_fit.stride=1", "--set", "attack.trace_fit.val_fraction=0.3",
           "--out", str(out), "--quiet"]
    for shard in (9, 10, 11, 12):  # ppo, noise:0.1: TRACE T = 1 and 8, decoder T = 1 and 8
        assert main([*run, "--shard", f"{shard}/34", "--resume"]) == 0
    for window in (1, 8):
        (attacker,) = (out / "attackers").glob(f"*defense=noise%3A0.1,attacker=trace,"
                                                f"window={window},*")
        meta = json.loads((attacker / "attacker.json").read_text())
        text = json.dumps(meta)
        assert '"noise:0.1"' in text and '"structured"' in text
        assert meta["model"]["window"] == window
    for window, context in ((1, "none"), (8, "warp")):  # the decoder's motion-aware context
        (attacker,) = (out / "attackers").glob(f"*defense=noise%3A0.1,attacker=decoder,"
                                                f"window={window},*")
        meta = json.loads((attacker / "attacker.json").read_text())
        assert meta["model"]["context"] == context and meta["fit"]["defense"] == "noise:0.1"
    assert main(["experiment", "context", "--merge", "--allow-partial", "--out", str(out),
                 "--results", str(results), "--quiet"]) == 0
    merged = json.loads((results / "context.json").read_text())
    verdicts = merged["summary"]["t8_minus_t1"]
    assert [v.split(": T = 8")[0] for v in verdicts] == [
        "- ppo, noise:0.1, TRACE", "- ppo, noise:0.1, the feature decoder"]
    assert all(v in (results / "context.md").read_text() for v in verdicts)


@pytest.mark.slow
def test_defense_figure_draws_the_best_adapted_attacker_per_defense(tmp_path) -> None:
    """Two defenses of the grid: every learned attacker trained under its cell's defense, the
    best of the three attacks named per cell, and --merge draws the picture from the cells'
    saved frames (refused, naming the cell, when those frames are gone)."""
    from helpers import TINY
    from PIL import Image

    out, results = tmp_path / "figure", tmp_path / "results"
    run = ["experiment", "defense-figure", "--seeds", "1", "--budget-minutes", "0.05", *TINY,
           "--set", "capture.steps_train=96", "--set", "capture.steps_heldout=40",
           "--out", str(out), "--quiet"]
    assert main([*run, "--shard", "0/5"]) == 0  # no defense
    assert main([*run, "--shard", "1/5", "--resume"]) == 0  # quant:8
    for defense in ("none", "quant:8"):
        for method in ("trace", "lti"):
            (attacker,) = (out / "attackers").glob(f"*defense={quote(defense)},*/{method}")
            fit = json.loads((attacker / "attacker.json").read_text())["fit"]
            assert fit["defense"] == defense
    for cell in (out / "cells").iterdir():
        result = json.loads(cell.read_text())["result"]
        assert set(result["attacks"]) == {"TRACE", "LtI", "training-free"}
        assert result["best"] == max(result["attacks"],
                                     key=lambda n: result["attacks"][n]["psnr"])
    assert main(["experiment", "defense-figure", "--merge", "--allow-partial", "--out",
                 str(out), "--results", str(results), "--quiet"]) == 0
    table = (results / "defense-figure.md").read_text()
    assert "![defense-figure](defense-figure.png)" in table
    merged = json.loads((results / "defense-figure.json").read_text())["summary"]
    cells = {json.loads(c.read_text())["cell"]["defense"]: json.loads(c.read_text())
             for c in (out / "cells").iterdir()}
    for defense, entry in merged.items():  # each reference row beside the attacks
        result = cells[defense]["result"]
        assert entry["mean_colour_psnr"] == [result["mean colour (oracle)"]["psnr"]]
        assert entry["mean_image_psnr"] == [result["mean training image"]["psnr"]]
        assert entry["cpu_minutes"] == [cells[defense]["cpu_minutes"]]
    assert "mean colour PSNR" in table and "CPU min / cell" in table
    width, height = Image.open(results / "defense-figure.png").size
    assert height > width / 8 * 2  # ground truth and two defenses' rows of 8 frames
    (samples,) = (out / "eval").glob("*defense=quant%3A8*/samples.npz")
    samples.unlink()
    assert main(["experiment", "defense-figure", "--merge", "--allow-partial", "--out",
                 str(out), "--results", str(results), "--quiet"]) == 2


@pytest.mark.slow
def test_auxscale_trains_on_nested_fractions_with_the_same_validation(tmp_path) -> None:
    from helpers import TINY

    out = tmp_path / "auxscale"
    run = ["experiment", "auxscale", "--seeds", "1", "--budget-minutes", "0.05", *TINY,
           "--set", "capture.steps_train=200", "--set", "capture.steps_heldout=30",
           "--set", "attack.trace_fit.val_fraction=0.2", "--out", str(out), "--quiet"]
    assert main([*run, "--shard", "1/12"]) == 0  # ppo, 30% of the episodes
    assert main([*run, "--shard", "5/12", "--resume"]) == 0  # ppo, all of them
    counts = {}
    for fraction in ("0.3", "1.0"):
        (attacker,) = (out / "attackers").glob(f"*fraction={fraction},*")
        meta = json.loads((attacker / "attacker.json").read_text())
        counts[fraction] = (meta["train_windows"], meta["val_windows"])
    assert counts["0.3"][0] < counts["1.0"][0] and counts["0.3"][1] == counts["1.0"][1]


@pytest.mark.slow
def test_table1_scores_learned_training_free_and_optimisation_attacks_alike(tmp_path) -> None:
    from helpers import TINY

    out, results = tmp_path / "table1", tmp_path / "results"
    run = ["experiment", "table1", "--seeds", "2", "--budget-minutes", "0.05", *TINY,
           "--set", "capture.steps_train=48", "--set", "capture.steps_heldout=24",
           "--set", "attack.ig.iterations=3", "--set", "attack.decoder_fit.extra_frames=0",
           "--out", str(out), "--quiet"]
    # ppo cells: trace 0-1, lti 2-3, decoder 4-5, exact 6 (one seed: deterministic), dlg 7-8,
    # ig 9-10; then a2c 11-21
    for index in (2, 4, 6, 9):
        assert main([*run, "--shard", f"{index}/22", "--resume"]) == 0
    assert main(["experiment", "table1", "--merge", "--allow-partial", "--out", str(out),
                 "--results", str(results), "--quiet"]) == 0
    merged = json.loads((results / "table1.json").read_text())
    labels = {c["cell"]["method"]: c["result"]["method_label"] for c in merged["cells"]}
    assert labels == {"lti": "LtI", "decoder": "feature decoder",
                      "exact": "training-free", "ig": "IG"}
    for cell in merged["cells"]:
        assert cell["result"]["attack"]["psnr"] > 0
        assert cell["result"]["mean training image"]["psnr"] > 0
    assert len(merged["missing"]) == 22 - 4
    # IG scored the first window only: its row's mean image is the one on those frames
    ig = next(c for c in merged["cells"] if c["cell"]["method"] == "ig")["result"]
    same = ig["attack"]["mean_image_psnr_same_frames"]
    assert same != ig["mean training image"]["psnr"]
    assert merged["summary"]["ppo/ig"]["mean_image_psnr"] == pytest.approx(same)


@pytest.mark.slow
def test_fewshot_fine_tunes_the_trained_attacker_on_other_heldout_episodes(tmp_path) -> None:
    from helpers import TINY

    from gradleak.capture.reader import CaptureFile

    out, shared = tmp_path / "fewshot", tmp_path / "shared"
    run = ["experiment", "fewshot", "--seeds", "1", "--budget-minutes", "0.05", *TINY,
           "--set", "capture.steps_train=60", "--set", "capture.steps_heldout=120",
           "--set", "attack.trace_fit.val_fraction=0.3", "--shared", str(shared),
           "--out", str(out), "--quiet"]
    assert main([*run, "--shard", "0/12"]) == 0  # ppo, 0%: the trained attacker as it is
    assert main([*run, "--shard", "5/12", "--resume"]) == 0  # ppo, fine-tuned on 50%
    records = {json.loads(p.read_text())["cell"]["percent"]: json.loads(p.read_text())["result"]
               for p in (out / "cells").iterdir()}
    assert records[50]["finetune_windows"] > 0 and "finetune_windows" not in records[0]
    (tuned,) = (out / "attackers").iterdir()
    meta = json.loads((tuned / "attacker.json").read_text())
    assert str(out / "base" / "ppo-seed0") in json.dumps(meta)  # started from the base
    (key,) = shared.iterdir()
    with CaptureFile(key / "capture-ppo-all-heldout.h5") as evaluation, \
            CaptureFile(key / "capture-ppo-all-heldout-finetune.h5") as finetune:
        assert evaluation.attrs["split"] == finetune.attrs["split"] == "heldout"
        assert evaluation.attrs["seed"] != finetune.attrs["seed"]  # other episodes


@pytest.mark.slow
def test_the_paper_script_runs_shards_side_by_side_merges_and_resumes(tmp_path) -> None:
    """benchmarks/paper_experiments.sh on a user's toy grid: two shards, every cell run once,
    merged; run again, it runs no cell a second time and merges the same result."""
    import os
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks" / "paper_experiments.sh"
    env = {**os.environ, "OUT": str(tmp_path / "exp"), "SHARED": str(tmp_path / "shared"),
           "RESULTS": str(tmp_path / "results"), "BUDGET": "1",
           "EXTRA": "--plugin user_experiments",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for _ in range(2):
        done = subprocess.run(["bash", str(script), "toy"], env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        merged = json.loads((tmp_path / "results" / "toy.json").read_text())
        assert merged["summary"] == {"a": 0.5, "b": 10.5, "c": 20.5}
    ran = (tmp_path / "exp" / "toy-1m" / "ran.log").read_text().split()
    assert sorted(ran) == sorted(set(ran)) and len(ran) == 6


@pytest.mark.slow
def test_the_paper_script_runs_a_slice_first_and_merges_it_as_partial(tmp_path) -> None:
    import os
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks" / "paper_experiments.sh"
    env = {**os.environ, "OUT": str(tmp_path / "exp"), "SHARED": str(tmp_path / "shared"),
           "RESULTS": str(tmp_path / "results"), "BUDGET": "1", "WHERE": "setting=a,c seed=0",
           "EXTRA": "--plugin user_experiments",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(["bash", str(script), "toy"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    ran = (tmp_path / "exp" / "toy-1m" / "ran.log").read_text().split()
    assert sorted(ran) == ["setting=a,seed=0", "setting=c,seed=0"]
    merged = json.loads((tmp_path / "results" / "toy.json").read_text())
    assert len(merged["missing"]) == 4


@pytest.mark.slow
def test_shards_claiming_one_new_folder_take_turns(tmp_path, monkeypatch) -> None:
    """Two shards claim a folder none has made yet, the second while the first is still
    writing the run's marker (its temporary file already in the folder, slowed down here): the
    second waits its turn and joins the run instead of refusing the folder as a stranger's."""
    import threading
    import time

    from gradleak.experiments import runner
    from gradleak.experiments.runner import ExperimentSettings

    from gradleak.errors import ConfigError

    writing = threading.Event()

    def slow_write(path, data):
        with runner.atomic_path(path) as tmp:
            tmp.write_text(json.dumps(data))
            writing.set()
            time.sleep(0.5)  # the marker's temporary file sits in the folder meanwhile

    monkeypatch.setattr(runner, "write_json", slow_write)
    out, settings, errors = tmp_path / "run", ExperimentSettings(name="losses"), []

    def shard() -> None:
        try:
            runner.claim(out, settings, resume=True, cells=[])
        except ConfigError as error:  # reported by the assertion below
            errors.append(error)

    first = threading.Thread(target=shard)
    first.start()
    writing.wait(5)
    shard()
    first.join()
    assert errors == [] and json.loads((out / "experiment.json").read_text())["format"]


def test_a_single_seed_is_not_shown_as_seeds_that_agreed() -> None:
    from gradleak.experiments import mean_std

    assert mean_std([10.0, 11.0]) == "10.50 ± 0.50"
    assert mean_std([10.0]) == "10.00 (n = 1)"
    assert mean_std([]) == "-"


def test_context_verdict_pairs_t1_and_t8_seed_by_seed() -> None:
    """T = 8 against T = 1 per seed (a seed without both windows left out); 'beats' only when
    every seed gains, and seeds that disagree are said to."""
    from gradleak.experiments.context import seed_gains, verdict

    def record(window: int, seed: int, psnr: float) -> dict:
        return {"cell": {"victim": "a2c", "defense": "noise:0.1", "attacker": "decoder",
                         "window": window, "seed": seed},
                "result": {"attack": {"psnr": psnr}}}

    results = [record(1, 0, 20.0), record(8, 0, 19.9), record(1, 1, 21.0), record(8, 1, 21.2),
               record(1, 2, 22.0)]
    gains = seed_gains(results, "a2c", "noise:0.1", "decoder")
    assert gains == pytest.approx([-0.1, 0.2])
    assert verdict(gains) == "T = 8 against T = 1 depends on the seed"
    assert verdict([0.1, 0.2]) == "T = 8 beats T = 1"
    assert verdict([-0.1, 0.0]) == "T = 8 does not beat T = 1"
    assert seed_gains(results, "ppo", "noise:0.1", "decoder") == []
    assert verdict([]) == "T = 8 and T = 1 share no seed"


def test_a_staggered_job_array_and_a_second_run_of_one_folder_run_each_cell_once(
        tmp_path, capsys) -> None:
    """Shard 1/2 started after 0/2 finished runs its own cells without --resume; a second run
    of the folder skips the cells another process holds instead of running them twice."""
    from gradleak.io import exclusive

    out = tmp_path / "toy"
    run = ["experiment", "toy", *PLUGIN, "--seeds", "2", "--out", str(out), "--json"]
    assert main([*run, "--shard", "0/2"]) == 0
    assert main([*run, "--shard", "1/2"]) == 0  # staggered: its cells are not 0/2's
    assert len(ran(out)) == 6 and len(set(ran(out))) == 6
    assert main([*run, "--shard", "1/2"]) == 2  # but running a shard again wants --resume
    assert "pass --resume" in capsys.readouterr().err
    other = tmp_path / "other"
    capsys.readouterr()
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--out", str(other),
                 "--where", "seed=0", "--quiet"]) == 0
    cell = "setting=a,seed=1"
    with exclusive(other / "cells" / f".{cell}.json.lock", RuntimeError):  # another run has it
        assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--out", str(other),
                     "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["running_elsewhere"] == [cell] and cell not in summary["ran"]
    assert sorted(ran(other)) == sorted(set(ran(other))) and len(ran(other)) == 5


def test_values_differing_only_in_unsafe_characters_keep_their_own_cells() -> None:
    from gradleak.experiments.base import Cell

    ids = {Cell((("defense", value), ("seed", 0))).id for value in ("a:b", "a/b", "a b", "a_b",
                                                                     "a%3Ab")}
    assert len(ids) == 5 and not any("/" in i for i in ids)
    assert Cell((("victim", "ppo"), ("seed", 0))).id == "victim=ppo,seed=0"  # as before


@pytest.mark.parametrize("record, fragment", [
    ({}, "a cell record without this experiment's axes"),
    ({"cell": {"setting": "a", "seed": 0}, "result": None, "cpu_minutes": 1.0,
      "wall_minutes": 1.0}, "result None"),
    ({"cell": {"setting": "a", "seed": 0}, "result": {"value": 1.0}, "wall_minutes": 1.0},
     "cpu_minutes None"),
    ({"cell": {"setting": "b", "seed": 0}, "result": {"value": 1.0}, "cpu_minutes": 1.0,
      "wall_minutes": 1.0}, "holds the record of cell setting=b,seed=0"),
])
def test_a_merge_names_a_broken_cell_record(tmp_path, capsys, record, fragment) -> None:
    out, results = tmp_path / "toy", tmp_path / "results"
    assert main(["experiment", "toy", *PLUGIN, "--seeds", "1", "--out", str(out),
                 "--quiet"]) == 0
    (out / "cells" / "setting=a,seed=0.json").write_text(json.dumps(record))
    assert main(["experiment", "toy", *PLUGIN, "--merge", "--out", str(out), "--results",
                 str(results)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "setting=a,seed=0.json" in err and "Traceback" not in err
    assert not results.exists()
    (out / "cells" / "setting=a,seed=0.json").write_text('"a string"')
    assert main(["experiment", "toy", *PLUGIN, "--merge", "--out", str(out), "--results",
                 str(results)]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


def test_what_is_read_and_built_from_a_users_numbers_is_bounded(tmp_path, capsys) -> None:
    import os

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    for source in (str(fifo), "/dev/zero"):
        assert main(["experiment", "toy", *PLUGIN, "--out", str(tmp_path / "a"),
                     "--import-cells", source]) == 2  # neither hangs nor fills the memory
        assert "not a regular file" in capsys.readouterr().err
    assert main(["experiment", "table1", "--seeds", "1000000000", "--where", "seed=0",
                 "--out", str(tmp_path / "b")]) == 2
    assert "--seeds 1000000000: expected an integer from 1 to 1000" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_import_with_a_broken_record_is_refused_before_any_cell(tmp_path, capsys) -> None:
    """A merged result's record without its minutes or with no result was imported and then
    broke the merge: it is refused at import, naming the cell."""
    _, results = half_a_grid_merged(tmp_path)
    merged = json.loads((results / "toy.json").read_text())
    for change, fragment in (({"result": None}, "result None"),
                             ({"cpu_minutes": None}, "cpu_minutes None")):
        broken = tmp_path / "broken.json"
        broken.write_text(json.dumps({**merged, "cells": [{**merged["cells"][0], **change},
                                                          *merged["cells"][1:]]}))
        capsys.readouterr()
        assert main(["experiment", "toy", *PLUGIN, "--seeds", "2", "--out",
                     str(tmp_path / "later"), "--import-cells", str(broken)]) == 2
        assert fragment in capsys.readouterr().err
        assert not (tmp_path / "later").exists()
