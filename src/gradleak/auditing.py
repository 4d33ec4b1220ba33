"""`gradleak audit`: what one held-out capture gives away, and which defense stops it.

Stages, in the order a reader needs them; each is written atomically under the output folder
as soon as it is done, and a rerun with the same settings reads finished stages back instead of
redoing them (a larger --budget-minutes completes what a smaller one skipped):

1. `actions`: the closed-form action rules on every step;
2. `closed_form`: actions, advantages and returns recovered from each step's gradient;
3. `attackers`: the learned attackers given, or trained on a training capture within their
   share of the budget;
4. `clean`: every attack on the undefended stream (the training-free frames, the learned
   attackers) beside the mean-image and mean-colour references;
5. one stage per defense of the grid: the same attacks zero-shot under it and the action rule,
   with the defense's cost to the update (cosine, relative norm error, DP-SGD's ε);
6. `optimisation baselines`: DLG and IG on a few clean frames, last: they cost seconds per frame
   and trail the training-free attack, which sees the same single gradients, so they never
   take the defense stages' budget. Their rows join the clean stage's in results.json.

A defense stage the remaining budget cannot pay for (the clean stage's time on the same clock
is the estimate) is skipped,
and the verdict and the report name it and say they cannot speak for it; with
`defenses_within_budget=False` (the demo's small grid) every defense stage runs.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gradleak.attacks.catalogue import choices
from gradleak.capture.reader import CaptureFile
from gradleak.defenses import Chain, parse_defense
from gradleak.errors import ConfigError
from gradleak.evaluation.actions import evaluate_action_rules
from gradleak.evaluation.analytic import evaluate_analytic
from gradleak.io import check_output, exclusive, read_json, write_json
from gradleak.presets import AttackConfig, Preset, load_preset
from gradleak.threat import Observation, declared
from gradleak.training.loop import CLOCKS, Budget
from gradleak.victims.base import rebuildable

# from light to strong within each family; the verdict looks for the cheapest that stops all
GRID = ("cast:float16", "quant:8", "quant:4", "prune:0.5", "prune:0.1", "noise:1e-05",
        "noise:0.001", "noise:0.01", "noise:0.1", "dpsgd:eps=10", "dpsgd:eps=1", "agg:8")
RULES = ("odd-sign", "sign-agnostic", "sign-aware")
OPTIMISATION = ("dlg", "ig")  # the single-step optimisation baselines, on a few frames
MARKER = "audit.json"  # the settings; its presence says the folder is an audit's own
LOCK = ".audit.lock"  # held by the audit writing the folder (io.exclusive)
# why the default grid's aggregates are left out of an audit without learned attackers
NEEDS_LEARNED = ("needs a learned attacker (--train or --attacker): an aggregate of steps is "
                 "read only by them")
TRAIN_SHARE = {"trace": 0.25, "lti": 0.10}  # of the budget, when attackers are trained here
OPTIMISATION_STAGE = "optimisation baselines"


@dataclass
class AuditConfig:
    """Everything an audit's numbers depend on (saved as audit.json beside them)."""

    capture: str
    out: str
    train: str | None = None
    attackers: dict[str, str] = field(default_factory=dict)
    defenses: list[str] = field(default_factory=lambda: list(GRID))
    preset: str = "cpu-quick"
    overrides: list[str] = field(default_factory=list)  # --set SECTION.FIELD=VALUE
    budget_minutes: float = 20.0
    clock: str = "wall"  # or "cpu": this process's CPU time, all its threads (shared machines)
    max_windows: int = 32  # held-out windows the learned attackers and references score
    training_free_windows: int = 2  # windows the training-free attack inverts
    optimisation_windows: int = 1  # windows DLG and IG invert (seconds per frame each)
    optimisation: list[str] = field(default_factory=lambda: list(OPTIMISATION))
    seed: int = 0
    # False: every defense stage runs whatever the budget has left (a grid sized to finish, as
    # the demo's: a verdict that skipped its defenses would say nothing about them)
    defenses_within_budget: bool = True

    @property
    def learned(self) -> bool:
        """Learned attackers are given or trained here."""
        return bool(self.attackers or self.train)

    def check(self) -> None:
        """Every argument and file, before any compute."""
        if self.clock not in CLOCKS:
            raise ConfigError(f"--clock {self.clock}: expected one of {', '.join(CLOCKS)}")
        if not self.budget_minutes > 0:
            raise ConfigError(f"--budget-minutes {self.budget_minutes}: expected a positive "
                              "number")
        for name in ("max_windows", "training_free_windows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected "
                                  "at least 1")
        if self.optimisation_windows < 0:
            raise ConfigError("--optimisation-windows: expected 0 or more")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"--seed {self.seed}: expected an integer from 0 to 2**32 - 1")
        for spec in self.defenses:  # a ConfigError names a spec it cannot read
            if parse_defense(spec).span > 1 and not self.learned and self.defenses != \
                    list(GRID):  # the default grid leaves it out and says so (`run`)
                raise ConfigError(f"--defenses {spec}: it aggregates steps, which only learned "
                                  "attackers read; give --attacker or --train, or leave it out")
        optimisation = [name for name, (attack, _) in choices(AttackConfig()).items()
                        if attack.kind == "optimisation"]
        for name in self.optimisation:
            if name not in optimisation:
                raise ConfigError(f"--optimisation {name!r}: expected some of "
                                  f"{', '.join(optimisation)}")
        for path, what in ((self.capture, "--capture"), (self.train, "--train")):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{what} {path}: no such capture file")
        with CaptureFile(self.capture) as capture:
            if capture.attrs["split"] != "heldout":
                raise ConfigError(f"--capture {self.capture}: a capture of "
                                  f"{capture.attrs['split']!r} scenes; the audit scores "
                                  "held-out scenes (capture with --scenes heldout)")
            rebuildable(capture.victim)  # a model it names must be registered: refused here
        from gradleak.training.checkpoint import META

        for name, folder in self.attackers.items():
            if not (Path(folder) / META).is_file():
                raise ConfigError(f"--attacker {name}={folder}: not an attacker run (no {META})")


@dataclass
class Stage:
    name: str
    result: dict[str, Any] | None = None  # None: skipped, `skipped` says why
    skipped: str | None = None
    seconds: float = 0.0


class Audit:
    """Runs the stages against a time budget, reusing the ones already on disk."""

    def __init__(self, config: AuditConfig, progress: bool = True,
                 say: Callable[[str], None] = lambda text: None,
                 preset: Preset | None = None) -> None:
        """`preset`: settings already built (the demo's, with its --set), else the named one
        with `config.overrides`; saved as preset.json beside audit.json either way."""
        config.check()
        self.config, self.progress, self.say = config, progress, say
        self.out = Path(config.out)
        self.preset = preset or load_preset(config.preset, config.overrides)  # before the folder
        self.budget = Budget(config.budget_minutes, config.clock)
        self.stages: dict[str, Stage] = {}
        with CaptureFile(config.capture) as capture:
            transform = capture.roles.transform
        # what cannot run on these frames is left out up front, and named in the verdict
        self.learned_reason = None if transform.rgb or not config.learned else (
            f"frames of {'×'.join(map(str, transform.frame_shape))} (a stack of "
            f"{transform.stack}): the learned attackers reconstruct square RGB frames")
        self.content = check_folder(self.out, config)  # before any compute

    # -- bookkeeping -------------------------------------------------------------------------
    def minutes_left(self) -> float:
        return self.budget.minutes_left()

    def stage(self, name: str, run: Callable[[], dict[str, Any]],
              estimate_minutes: float | None = None) -> Stage:
        """Runs `run` unless it is on disk already, or it has an estimate (the grid's stages
        do; the core ones always run) that the budget left cannot pay."""
        path = self.out / "stages" / f"{slug(name)}.json"
        if path.is_file():
            saved = read_stage(path, name)
            stage = Stage(name, saved["result"], seconds=float(saved.get("seconds", 0.0)))
        elif estimate_minutes is not None and estimate_minutes > self.minutes_left():
            stage = Stage(name, skipped=f"budget: about {estimate_minutes:.1f} min needed, "
                                        f"{max(self.minutes_left(), 0):.1f} left")
        else:
            self.say(f"audit: {name}")
            tick = self.budget.now()
            result = run()
            stage = Stage(name, result, seconds=round(self.budget.now() - tick, 2))
            write_json(path, {"name": name, "seconds": stage.seconds, "result": result})
        self.stages[name] = stage
        return stage

    # -- the stages --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Every stage, with the folder held against other audits for the whole run."""
        self.out.mkdir(parents=True, exist_ok=True)
        with exclusive(self.out / LOCK, lambda holder: ConfigError(
                f"--out {self.out} is being written by another audit (PID {holder}): wait for "
                "it to finish, or choose another folder")):
            write_json(self.out / MARKER, {**asdict(self.config), "content": self.content})
            write_json(self.out / "preset.json", self.preset.to_dict())
            return self._run()

    def _run(self) -> dict[str, Any]:
        from gradleak.evaluation.verdict import verdict

        self.stage("actions", lambda: evaluate_action_rules([self.config.capture], RULES))
        self.stage("closed form", self.closed_form)
        attackers = self.stage("attackers", self.attackers).result or {}
        clean = self.stage("defense none", lambda: self.evaluate("none", attackers))
        estimate = clean.seconds / 60.0  # a defense stage runs what the clean one ran
        for spec in self.config.defenses:
            if parse_defense(spec).span > 1 and not attackers:
                self.stages[f"defense {spec}"] = Stage(f"defense {spec}", skipped=NEEDS_LEARNED)
                continue
            done = self.stage(f"defense {spec}", lambda spec=spec: self.evaluate(spec, attackers),
                              estimate_minutes=estimate if self.config.defenses_within_budget
                              else None)
            estimate = max(estimate, done.seconds / 60.0)
        if self.config.optimisation and self.config.optimisation_windows:
            # last: seconds per frame each, so they never starve the defense stages
            self.stage(OPTIMISATION_STAGE, lambda: self.optimisation_baselines(attackers))
        summary = {"config": asdict(self.config), "capture": self.capture_summary(),
                   "stages": {name: {"result": s.result, "skipped": s.skipped,
                                     "seconds": s.seconds} for name, s in self.stages.items()},
                   # the stages' own time, over every run that resumed this audit
                   "minutes": round(sum(s.seconds for s in self.stages.values()) / 60.0, 2)}
        with_optimisation(summary["stages"])
        summary["verdict"] = verdict(summary)
        write_json(self.out / "results.json", summary)
        return summary

    def closed_form(self) -> dict[str, Any]:
        """The closed form's scores, or why the victim's structure does not allow it."""
        try:
            return evaluate_analytic([self.config.capture])[self.config.capture]
        except ConfigError as error:
            return {"not_applicable": str(error)}

    def capture_summary(self) -> dict[str, Any]:
        with CaptureFile(self.config.capture) as capture:
            summary = capture.summary()
            summary["scene_names"] = [str(scene) for scene in capture.scenes[:12]]
        return summary

    def attackers(self) -> dict[str, str]:
        """The attackers given, or TRACE and LtI trained on --train within their budget share
        (each fit stops at its time limit and keeps its best epoch)."""
        if self.learned_reason:
            return {}
        if self.config.attackers or not self.config.train:
            return dict(self.config.attackers)
        from gradleak.training.checkpoint import display_name
        from gradleak.training.fit import fit_attacker

        trained = {}
        for kind, share in TRAIN_SHARE.items():
            model, fit = copy.deepcopy(self.preset.attack.learned(kind))
            fit.time_limit_minutes = share * self.config.budget_minutes
            fit.time_limit_clock = self.config.clock
            folder = self.out / "attackers" / kind
            fit_attacker(kind, model, fit, [self.config.train], folder, resume=folder.exists(),
                         progress=self.progress)
            trained[display_name(kind)] = str(folder)
        return trained

    def single_step_attacks(self, chain: Chain) -> tuple[dict[str, Any], dict[str, str | None]]:
        """Under one defense: every training-free single-step attack the registry offers that
        can read the stream (row name → settings), and why each other one cannot. One that
        models a declared defense is left out silently only where the stream has none (an
        undefended capture's clean stage); a capture `gradleak defend` wrote has one there."""
        seen = self.seen(chain)
        baselines: dict[str, Any] = {}
        reasons: dict[str, str | None] = {}
        for choice, (attack, settings) in choices(self.preset.attack).items():
            if attack.kind != "training-free" or (
                    "declared defense" in attack.needs and not seen.defense):
                continue
            label = attack.label(choice, settings)
            reasons[label] = attack.missing(seen)
            if chain.span == 1 and reasons[label] is None:  # single steps, not aggregates
                baselines[label] = settings
        return baselines, reasons

    def evaluate(self, spec: str, attackers: dict[str, str]) -> dict[str, Any]:
        """Under one defense: the learned attackers and the single-step attacks that apply."""
        from gradleak.evaluation.reconstructions import evaluate

        chain = parse_defense(spec, seed=self.config.seed)
        baselines, reasons = self.single_step_attacks(chain)
        reasons["learned attackers"] = self.learned_reason
        result = evaluate([self.config.capture], attackers,
                          self.out / "eval" / slug(spec), max_windows=self.config.max_windows,
                          defense=None if spec == "none" else chain, baselines=baselines,
                          baseline_windows=dict.fromkeys(baselines,
                                                         self.config.training_free_windows),
                          progress=self.progress,
                          reference_data=self.reference_data(attackers))
        return {**result, "spec": spec, "eval_dir": str(self.out / "eval" / slug(spec)),
                "not_applicable": {k: v for k, v in reasons.items() if v}}

    def optimisation_baselines(self, attackers: dict[str, str]) -> dict[str, Any]:
        """DLG and IG on the undefended stream, on their own few windows (seconds per frame
        each)."""
        from gradleak.evaluation.reconstructions import evaluate

        offered = choices(self.preset.attack)
        baselines = {offered[name][0].label(name, offered[name][1]): offered[name][1]
                     for name in self.config.optimisation}
        out = self.out / "eval" / slug(OPTIMISATION_STAGE)
        # the attackers too, on these few windows only: the same mean image as the clean stage
        # (theirs when no training capture is named); only DLG's and IG's rows are kept
        windows = self.config.optimisation_windows
        result = evaluate([self.config.capture], attackers, out, max_windows=windows,
                          baselines=baselines,
                          baseline_windows=dict.fromkeys(baselines, windows),
                          progress=self.progress,
                          reference_data=self.reference_data(attackers))
        return {**result, "spec": "none", "eval_dir": str(out)}

    def reference_data(self, attackers: dict[str, str]) -> list[str] | None:
        """What the mean image is the mean of: the training capture, else the attackers'
        (None), else the audited frames themselves."""
        return [self.config.train] if self.config.train else \
            None if attackers else [self.config.capture]

    def seen(self, chain: Chain) -> Observation:
        """What the server holds of the audited stream under `chain`, without its rows: the
        layout, θ0, the loss, and the defenses declared (the capture's own, then the chain's)."""
        with CaptureFile(self.config.capture) as capture:
            seen = capture.observation(rows=slice(0, 0))
        return replace(seen, defense=seen.defense + declared(chain.describe()["transforms"]))


def read_stage(path: Path, name: str) -> dict[str, Any]:
    """A finished stage read back, checked as the verdict reads it (the file is the audit's
    own, but a disk or a hand may have changed it)."""
    saved = read_json(path, f"audit stage {name}")
    result, seconds = saved.get("result"), saved.get("seconds", 0.0)
    problem = None
    if not isinstance(result, dict):
        problem = f"'result' is {type(result).__name__}, expected an object"
    elif "methods" in result and not (isinstance(result["methods"], dict) and all(
            isinstance(row, dict) and isinstance(row.get("kind"), str)
            for row in result["methods"].values())):
        problem = "'methods' is not an object of method rows (each with its 'kind')"
    elif isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        problem = f"'seconds' is {seconds!r:.40}, expected a number >= 0"
    if problem:
        raise ConfigError(f"audit stage file {path}: {problem}; delete it to run that stage "
                          "again")
    return saved


def with_optimisation(stages: dict[str, dict[str, Any]]) -> None:
    """DLG's and IG's rows join the clean stage's methods, where every table reads them."""
    optimisation = (stages.get(OPTIMISATION_STAGE) or {}).get("result")
    clean = (stages.get("defense none") or {}).get("result")
    if optimisation and clean:
        clean["methods"] = {**clean["methods"],
                            **{name: row for name, row in optimisation["methods"].items()
                               if row["kind"] == "optimisation"}}


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in ".-_" else "-" for c in text)


def content(config: AuditConfig) -> dict[str, Any]:
    """The captures' content keys (θ0, rows, a digest): an audit's stages belong to the data
    they scored, not to the paths it had."""
    keys = {}
    for name, path in (("capture", config.capture), ("train", config.train)):
        if path is not None:
            with CaptureFile(path) as capture:
                keys[name] = capture.content_key()
    return keys


def check_folder(out: Path, config: AuditConfig) -> dict[str, Any]:
    """A new or empty folder, or this audit's own (same settings but the budget, same capture
    content): then its finished stages are reused. Anything else is refused, untouched.
    Returns the captures' content keys, which the marker records."""
    check_output(out, "--out", directory=True)
    marker = out / MARKER
    mine = {**asdict(config), "content": content(config)}
    if out.exists() and any(p.name != LOCK for p in out.iterdir()):
        if not marker.is_file():
            raise ConfigError(f"--out {out} is not empty and holds no {MARKER}: choose a new "
                              "or empty folder (an audit resumes only in its own)")
        earlier = read_json(marker, "audit settings")
        if "exact_windows" in earlier:  # the field's name before training_free_windows
            earlier["training_free_windows"] = earlier.pop("exact_windows")
        changed = sorted(key for key in mine if key not in ("budget_minutes", "clock", "out")
                         and earlier.get(key) != json.loads(json.dumps(mine[key])))
        if "content" in changed:
            before, now = earlier.get("content") or {}, mine["content"]
            which = [n for n in now if before.get(n) != now[n]] or ["capture"]
            raise ConfigError(f"--out {out} holds an audit of other data at the same path: "
                              + "; ".join(f"--{n} {getattr(config, n)} was "
                                          f"{describe_key(before.get(n))}, now "
                                          f"{describe_key(now.get(n))}" for n in which)
                              + ". Choose a new folder: its stages scored the old data")
        if changed:
            raise ConfigError(f"--out {out} holds an audit with other settings "
                              f"({', '.join(changed)}): choose a new folder, or rerun with "
                              "its settings to resume it")
    return mine["content"]


def describe_key(key: dict[str, Any] | None) -> str:
    if not key:
        return "not recorded"
    return f"{key['rows']} rows, θ0 {key['theta0_sha256'][:12]}…, digest {key['digest']}"



@dataclass(frozen=True)
class Verdict:
    """What `gradleak.audit` returns: the verdict's figures, and where the report is."""

    headline: list[str]  # the verdict, as the report and the CLI open with it
    frames_method: str | None  # the strongest frame attack on the undefended stream
    frames_psnr: float | None
    frames_gain_db: float | None  # its PSNR over the mean-image reference
    frames_lpips: float | None
    actions_accuracy: float | None  # the best closed-form action rule
    weakest_stopping: str | None  # the cheapest defense that stops every attack, if any
    # stopping defenses whose update stays nearly the clean one: the attacks fell short there
    unproven: list[str]
    skipped: list[str]  # stages the budget did not pay for: the verdict cannot speak for them
    report: Path
    results: Path
    details: dict[str, Any]  # the whole verdict, as results.json holds it

    @classmethod
    def of(cls, verdict: dict[str, Any], report: Path, results: Path) -> Verdict:
        frames, actions = verdict.get("frames") or {}, verdict.get("actions") or {}
        return cls(headline=list(verdict["headline"]), frames_method=frames.get("method"),
                   frames_psnr=frames.get("psnr"), frames_gain_db=frames.get("gain"),
                   frames_lpips=frames.get("lpips"), actions_accuracy=actions.get("accuracy"),
                   weakest_stopping=verdict.get("weakest_stopping"),
                   unproven=list(verdict.get("unproven") or []),
                   skipped=sorted(verdict.get("skipped") or {}), report=report,
                   results=results, details=verdict)


def audit(capture: str | Path, *, out: str | Path, train: str | Path | None = None,
          attackers: dict[str, str] | None = None, defenses: list[str] | None = None,
          budget_minutes: float = 20.0, clock: str = "wall", preset: str = "cpu-quick",
          progress: bool = False, **settings: Any) -> Verdict:
    """Audit one held-out capture as `gradleak audit` does: every applicable attack, the
    defense grid (`defenses`: specs such as "quant:8", None for the default grid, [] for none)
    within the budget, report.html and results.json under `out`. `settings`: the other
    AuditConfig fields (max_windows, training_free_windows, optimisation_windows, seed, ...)."""
    from gradleak.report.audit import write_audit_report

    if "exact_windows" in settings:  # the field's name before training_free_windows
        settings["training_free_windows"] = settings.pop("exact_windows")
    unknown = sorted(set(settings) - set(AuditConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"gradleak.audit: unknown setting(s) {', '.join(unknown)}; expected "
                          f"AuditConfig's fields")
    config = AuditConfig(capture=str(capture), out=str(out),
                         train=None if train is None else str(train),
                         attackers={k: str(v) for k, v in (attackers or {}).items()},
                         defenses=list(GRID) if defenses is None else list(defenses),
                         preset=preset, budget_minutes=budget_minutes, clock=clock, **settings)
    summary = Audit(config, progress, say=print if progress else (lambda _: None)).run()
    report = write_audit_report(Path(out))
    return Verdict.of({**summary["verdict"], "minutes": summary["minutes"]}, report,
                      Path(out) / "results.json")
