"""The audit's verdict: what comes back, how well, and the cheapest defense that stops it.

A defense "stops" the attacks only when every frame attack is at the reference on all three
image metrics and every action read off the gradients is at chance:

- PSNR, SSIM and LPIPS each at the mean image, within the margins of `metrics.leak` (a learned
  attacker can sit at the mean image in PSNR while its LPIPS is half the mean image's: PSNR
  alone would call that stopped);
- actions: within three binomial standard deviations of 1/K over the frames scored.

A learned attacker is also set against its control, itself fed other steps' gradients: on each
metric and on its actions, the better of the control and the reference is what it must beat
(what its training alone gives is no leak of these gradients). A metric an attack did not
measure cannot clear it (the verdict names the missing one). The
weakest stopping defense is the one that costs the update least (highest cosine to the clean
update); a stopping defense that leaves the update nearly intact (cosine ≥ `INTACT_COSINE`) is
listed as unproven, with a caution: the attacks fell short, not the information. A defense stage that did not run is named, and the verdict says it cannot speak for
it. `--fail-if` conditions are read against the clean figures, with a small grammar
(`psnr>25 or actions>0.5`), never eval'd.
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any

from gradleak.errors import ConfigError
from gradleak.evaluation.scoring import MEAN_COLOUR, MEAN_IMAGE, control_name
from gradleak.metrics.leak import LPIPS_MARGIN, SSIM_MARGIN, STOP_MARGIN_DB, leaks

USEFUL_COSINE = 0.5  # below it the defended update points more along noise than the clean one
# at or above it the defended update is nearly the clean one: a defense that "stops" every attack
# there has removed little of what the gradients carry, so the attacks are what fall short
INTACT_COSINE = 0.9
ATTACK_KINDS = ("learned", "training-free", "optimisation")
# what the mean-image reference is the mean of (evaluation.reconstructions.mean_image_of)
REFERENCES = {"training frames": "the mean training image",
              "audited frames": "the mean of the audited frames themselves (no training "
                                "capture was given; it has seen the frames it is scored on, so "
                                "gains over it understate the leak)"}


def attack_rows(methods: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: row for name, row in methods.items() if row["kind"] in ATTACK_KINDS}


def action_rows(methods: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every method that reads actions off the gradients (the references guess none, and a
    control reads other steps' gradients)."""
    return {name: row for name, row in methods.items()
            if row["kind"] not in ("reference", "control")
            and row.get("action_accuracy") is not None}


def at_chance(row: dict[str, Any], chance: float, control: dict[str, Any] | None = None
              ) -> bool:
    """Whether the actions a method reads are no better than chance (1/K), or than its own
    control's (a learned attacker fed other steps' gradients predicts the actions its training
    made likely: a skewed action marginal is no leak of these gradients), within three
    binomial standard deviations over the frames scored."""
    level = max(chance, (control or {}).get("action_accuracy") or 0.0)
    spread = 3.0 * math.sqrt(level * (1.0 - level) / max(row.get("frames") or 1, 1))
    return row["action_accuracy"] <= level + spread


def defense_outcome(spec: str, stage: dict[str, Any], chance: float) -> dict[str, Any]:
    result = stage["result"]
    if result is None:
        return {"spec": spec, "skipped": stage["skipped"]}
    methods = result["methods"]
    frames = attack_rows(methods)
    best = max(frames.items(), key=lambda item: item[1].get("psnr", -math.inf), default=None)
    actions = action_rows(methods)
    best_actions = max((row["action_accuracy"] for row in actions.values()), default=None)
    reference = methods[MEAN_IMAGE]
    leaking = {name: found for name, row in frames.items()
               if (found := leaks(row, reference, methods.get(control_name(name))))}
    above_chance = sorted(name for name, row in actions.items()
                          if not at_chance(row, chance, methods.get(control_name(name))))
    stops = not leaking and not above_chance
    utility = result.get("utility") or {}
    transforms = (result.get("defense") or {}).get("transforms", [])
    dp = next((t for t in transforms if "achieved_eps" in t), None)
    return {"spec": spec, "stops": stops, "skipped": None,
            "best_attack": best[0] if best else None,
            "best_psnr": best[1].get("psnr") if best else None,
            "best_gain": best[1].get("psnr_gain_over_mean_image") if best else None,
            "best_action_accuracy": best_actions,
            "leaking": leaking, "actions_above_chance": above_chance,
            "mean_image_psnr": reference.get("psnr"), "mean_image_ssim": reference.get("ssim"),
            "mean_image_lpips": reference.get("lpips"),
            "cosine": utility.get("cosine"), "relative_norm_error":
                utility.get("relative_norm_error"),
            "epsilon": dp["achieved_eps"] if dp else None,
            # what ε stands on: the noise multiplier, the clipping norm, the sampling rate and
            # the number of noisy steps the accountant was given
            "dp": {key: dp[key] for key in ("sigma", "clip", "q", "steps", "delta")}
            if dp else None,
            "per_attack": {name: {key: row.get(key) for key in
                                  ("psnr", "ssim", "lpips", "psnr_gain_over_mean_image",
                                   "action_accuracy", "frames")}
                           for name, row in {**frames, **actions}.items()}}


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    stages, capture = summary["stages"], summary["capture"]
    chance = 1.0 / capture["num_actions"]
    result: dict[str, Any] = {"chance": chance, "stop_margin_db": STOP_MARGIN_DB,
                              "ssim_margin": SSIM_MARGIN, "lpips_margin": LPIPS_MARGIN,
                              "skipped": {name: s["skipped"] for name, s in stages.items()
                                          if s["skipped"]}}
    rules = (stages.get("actions") or {}).get("result") or {}
    honest = {rule: r for rule, r in rules.items() if not r.get("oracle_advantage_sign")}
    if honest:
        rule, best = max(honest.items(), key=lambda item: item[1]["accuracy"])
        result["actions"] = {"rule": rule, "accuracy": best["accuracy"], "steps": best["n"]}
    closed = (stages.get("closed form") or {}).get("result")
    if closed and "not_applicable" in closed:
        result["not_applicable"] = {"closed form": closed["not_applicable"]}
    elif closed:
        result["closed_form"] = {"actions": closed["action_accuracy"],
                                 "advantages": closed["advantage_exact_fraction"],
                                 "returns": closed["returns_exact_fraction"],
                                 "steps": closed["rows"]}
    clean = (stages.get("defense none") or {}).get("result")
    if clean:
        result.setdefault("not_applicable", {}).update(clean.get("not_applicable") or {})
        methods = clean["methods"]
        frames = attack_rows(methods)
        if frames:
            name, row = max(frames.items(), key=lambda item: item[1].get("psnr", -math.inf))
            result["frames"] = {"method": name, "psnr": row.get("psnr"), "ssim": row.get("ssim"),
                                "lpips": row.get("lpips"),
                                "gain": row.get("psnr_gain_over_mean_image"),
                                "frames": row.get("frames"),
                                "mean_image_psnr": methods[MEAN_IMAGE].get("psnr"),
                                "mean_image_ssim": methods[MEAN_IMAGE].get("ssim"),
                                "mean_image_lpips": methods[MEAN_IMAGE].get("lpips"),
                                "mean_colour_psnr": methods[MEAN_COLOUR].get("psnr")}
        result["reference"] = REFERENCES[clean.get("mean_image_of", "training frames")]
    outcomes = [defense_outcome(name.removeprefix("defense "), stage, chance)
                for name, stage in stages.items() if name.startswith("defense ")
                and name != "defense none"]
    result["defenses"] = outcomes
    stopping = [o for o in outcomes if o.get("stops")]
    result["weakest_stopping"] = max(stopping, key=lambda o: o["cosine"] if o["cosine"]
                                     is not None else -math.inf)["spec"] if stopping else None
    # stopped by the attacks' measure, yet the update is nearly intact: unproven, never "safe"
    result["unproven"] = [o["spec"] for o in stopping
                          if o["cosine"] is not None and o["cosine"] >= INTACT_COSINE]
    result["headline"] = headline(result)
    return result


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def headline(v: dict[str, Any]) -> list[str]:
    """The verdict as sentences a person reads in ten seconds."""
    lines = []
    if "actions" in v:
        a = v["actions"]
        lines.append(f"Actions: {_pct(a['accuracy'])} of {a['steps']} held-out steps' actions "
                     f"are read off single gradients ({a['rule']} rule, no training; chance "
                     f"{_pct(v['chance'])}).")
    if "closed_form" in v:
        c = v["closed_form"]
        lines.append(f"Closed form: {_pct(c['advantages'])} of advantages and "
                     f"{_pct(c['returns'])} of returns come back exactly (within 0.1%).")
    if "frames" in v:
        f = v["frames"]
        lpips = f" / LPIPS {f['lpips']:.3f}" if f.get("lpips") is not None else ""
        lines.append(f"Frames: the best attack, {f['method']}, reconstructs them at "
                     f"{f['psnr']:.1f} dB / SSIM {f['ssim']:.3f}{lpips}, {f['gain']:+.1f} dB "
                     f"against {v.get('reference', REFERENCES['training frames'])} "
                     f"({f['mean_image_psnr']:.1f} dB; each frame's own mean colour, an "
                     f"oracle: {f['mean_colour_psnr']:.1f} dB).")
    outcomes = [o for o in v["defenses"] if not o.get("skipped")]
    skipped = [o["spec"] for o in v["defenses"] if o.get("skipped")]
    if v["weakest_stopping"]:
        o = next(o for o in outcomes if o["spec"] == v["weakest_stopping"])
        cost = (f"update cosine {o['cosine']:.3f}, relative norm error "
                f"{o['relative_norm_error']:.3f}" if o["cosine"] is not None else "")
        useless = (" — at that cost the update keeps little of the clean one: no defense in "
                   "the grid both stops the attacks and leaves a useful update"
                   if o["cosine"] is not None and o["cosine"] < USEFUL_COSINE else "")
        lines.append(f"Defense: the weakest in the grid that brings every attack to the "
                     f"mean-image level (PSNR, SSIM and LPIPS) and actions to chance is "
                     f"{o['spec']} ({cost}{dp_text(o)}){useless}.")
    elif outcomes:
        lines.append(f"Defense: none of the {len(outcomes)} defenses tried brings every attack "
                     "to the mean-image level (PSNR, SSIM and LPIPS) and actions to chance.")
    for spec in v.get("unproven") or []:
        o = next(o for o in outcomes if o["spec"] == spec)
        lines.append(f"Caution: {spec} leaves the update at cosine {o['cosine']:.3f} to the "
                     "clean one, so it removes little of what the gradients carry; that every "
                     "attack here falls to the reference says these attacks cannot use what is "
                     "left, not that it is gone. Treat it as unproven, not as safe.")
    for o in outcomes:
        if not o["stops"]:
            lines.append(f"  {o['spec']}{cost_text(o)}: not stopped — " + "; ".join(
                [f"{name}: {', '.join(found)}" for name, found in o["leaking"].items()]
                + [f"{name}: actions above chance" for name in o["actions_above_chance"]])
                + ".")
    if skipped:
        lines.append(f"The verdict cannot speak for {', '.join(skipped)}: "
                     f"{'it was' if len(skipped) == 1 else 'they were'} not run, so whether "
                     f"{'it stops' if len(skipped) == 1 else 'they stop'} the attacks is "
                     "unknown.")
    for attack, reason in (v.get("not_applicable") or {}).items():
        lines.append(f"Not applicable to this victim: {attack} ({reason}).")
    budget = [name for name, why in v["skipped"].items() if why.startswith("budget")]
    if budget:
        lines.append(f"Not run within the budget: {', '.join(budget)}.")
    for name, why in v["skipped"].items():
        if name not in budget:
            lines.append(f"Not run: {name} ({why}).")
    return lines


def cost_text(o: dict[str, Any]) -> str:
    return f" (update cosine {o['cosine']:.3f}{dp_text(o)})" if o["cosine"] is not None else ""


def dp_text(o: dict[str, Any]) -> str:
    """ε with what it stands on: σ, the clipping norm C, the sampling rate q and the steps."""
    dp = o.get("dp")
    if not dp:
        return ""
    return (f", ε = {o['epsilon']:.2f} at δ = {dp['delta']:g} from σ = {dp['sigma']:.3g}, "
            f"C = {dp['clip']:g}, q = {dp['q']:.3g}, {dp['steps']} steps")


# -- --fail-if --------------------------------------------------------------------------------
OPERATORS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
             "==": operator.eq}
METRICS = {"psnr": ("frames", "psnr"), "ssim": ("frames", "ssim"), "lpips": ("frames", "lpips"),
           "gain": ("frames", "gain"), "actions": ("actions", "accuracy"),
           "advantages": ("closed_form", "advantages"), "returns": ("closed_form", "returns")}
CLAUSE = re.compile(r"^\s*([a-z]+)\s*(>=|<=|==|>|<)\s*([-+]?\d+(?:\.\d*)?(?:e[-+]?\d+)?)\s*$")


def parse_condition(text: str) -> list[list[tuple[str, str, float]]]:
    """`a>1 and b<2 or c>=3` as OR-groups of AND-ed clauses (and binds tighter)."""
    groups = []
    for part in re.split(r"\bor\b", text):
        clauses = []
        for clause in re.split(r"\band\b", part):
            match = CLAUSE.match(clause)
            if not match or match.group(1) not in METRICS:
                raise ConfigError(f"--fail-if {text!r}: cannot read {clause.strip()!r}; expected "
                                  f"METRIC OP NUMBER joined by 'and'/'or', METRIC one of "
                                  f"{', '.join(METRICS)}, OP one of {' '.join(OPERATORS)}")
            clauses.append((match.group(1), match.group(2), float(match.group(3))))
        groups.append(clauses)
    return groups


def condition_holds(groups: list[list[tuple[str, str, float]]], v: dict[str, Any]
                    ) -> tuple[bool, list[str]]:
    """Whether the condition holds on the verdict, and the clauses that held. A metric the
    audit did not measure makes its clause hold, and is named: a gate must never pass on what
    was not measured."""
    held = []

    def check(metric: str, op: str, number: float) -> bool:
        section, key = METRICS[metric]
        found = (v.get(section) or {}).get(key)
        if found is None:
            held.append(f"{metric} {op} {number:g}: not measured, so not cleared")
            return True
        ok = bool(OPERATORS[op](found, number))
        if ok:
            held.append(f"{metric} {found:.4g} {op} {number:g}")
        return ok

    result = any(all([check(*clause) for clause in group]) for group in groups)
    return result, list(dict.fromkeys(held))
