"""The audit's report.html: the verdict first, then the evidence for it, self-contained.

Every string that came from a file (capture attributes, scene and attacker names, paths) is
escaped: a capture is user data, and the report is opened in a browser.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradleak.errors import ConfigError
from gradleak.io import read_json
from gradleak.report.html import figure, page, table, write_page
from gradleak.report.plots import plot_privacy_utility
from gradleak.report.scores import lpips_reads, psnr_by_t_rows, table_columns, table_rows
from gradleak.report.tables import fixed


def _number(value: Any, digits: int) -> str | None:
    return fixed(value, digits) if isinstance(value, (int, float)) else None


def defense_rows(verdict: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for o in verdict["defenses"]:
        if o.get("skipped"):
            rows.append({"defense": o["spec"], "stops every attack": "not run",
                         "note": o["skipped"]})
            continue
        rows.append({"defense": o["spec"],
                     "stops every attack": "yes" if o["stops"] else "no",
                     "best attack": o["best_attack"], "its PSNR": _number(o["best_psnr"], 2),
                     "gain vs mean image": _number(o["best_gain"], 2),
                     "what still leaks": "; ".join(
                         f"{n}: {', '.join(f)}" for n, f in (o.get("leaking") or {}).items())
                     or None,
                     "best action acc.": _number(o["best_action_accuracy"], 3),
                     "update cosine": _number(o["cosine"], 3),
                     "update rel. error": _number(o["relative_norm_error"], 3),
                     "DP ε": _number(o["epsilon"], 2),
                     "DP σ, C, q, steps": (f"{o['dp']['sigma']:.3g}, {o['dp']['clip']:g}, "
                                           f"{o['dp']['q']:.3g}, {o['dp']['steps']}")
                     if o.get("dp") else None})
    return rows


DEFENSE_COLUMNS = ["defense", "stops every attack", "best attack", "its PSNR",
                   "gain vs mean image", "what still leaks", "best action acc.", "update cosine",
                   "update rel. error", "DP ε", "DP σ, C, q, steps", "note"]


def attack_by_defense(verdict: dict[str, Any], clean: dict[str, Any]
                      ) -> tuple[list[dict[str, Any]], list[str]]:
    """Each frame attack's PSNR gain (dB) and LPIPS under each defense, the clean stream
    first; an attack that runs only under defenses (the defense-aware one) has its column."""
    def cell(row: dict[str, Any] | None) -> str | None:
        if not row or row.get("psnr_gain_over_mean_image") is None:
            return None
        lpips = f" / {row['lpips']:.3f}" if row.get("lpips") is not None else ""
        return f"{row['psnr_gain_over_mean_image']:+.2f}{lpips}"

    names = [n for n, row in clean.items() if row.get("psnr_gain_over_mean_image") is not None
             and row["kind"] not in ("reference", "control")]
    for o in verdict["defenses"]:
        names += [n for n, row in (o.get("per_attack") or {}).items()
                  if row.get("psnr_gain_over_mean_image") is not None and n not in names]
    rows = [{"defense": "none", **{n: cell(clean.get(n)) for n in names}}]
    for o in verdict["defenses"]:
        if not o.get("skipped"):
            rows.append({"defense": o["spec"], **{n: cell(o["per_attack"].get(n))
                                                  for n in names}})
    return rows, ["defense", *names]


def closed_form_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for rule, r in ((summary["stages"].get("actions") or {}).get("result") or {}).items():
        rows.append({"what": f"actions, {rule} rule"
                     + (" (given the true advantage sign: an oracle)"
                        if r.get("oracle_advantage_sign") else ""),
                     "exact fraction": _number(r["accuracy"], 3), "steps": r["n"]})
    closed = (summary["stages"].get("closed form") or {}).get("result")
    if closed and "not_applicable" in closed:
        rows.append({"what": "closed form", "exact fraction": "not applicable: "
                     + closed["not_applicable"], "steps": None})
    elif closed:
        for what, key in (("actions, closed form", "action_accuracy"),
                          ("advantages", "advantage_exact_fraction"),
                          ("returns", "returns_exact_fraction")):
            rows.append({"what": what, "exact fraction": _number(closed[key], 3),
                         "steps": closed["rows"]})
        rows.append({"what": "advantages, median relative error",
                     "exact fraction": f"{closed['advantage_median_relative_error']:.2e}",
                     "steps": closed["rows"]})
    return rows


def capture_rows(capture: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("file", "victim", "algorithm", "frames", "num_actions", "rows", "episodes",
            "scenes", "scene_names", "gradient_dim", "components", "defenses", "roles",
            "theta0_sha256")
    return [{"field": key, "value": ", ".join(map(str, capture[key]))
             if isinstance(capture.get(key), list) else capture.get(key)} for key in keys
            if key in capture]


def write_audit_report(out: Path, figures: Sequence[tuple[Path, str]] = ()) -> Path:
    """`figures`: pictures made beside the audit (the demo's actions strip), after the verdict."""
    summary = read_json(out / "results.json", "audit results")
    if "verdict" not in summary or "stages" not in summary:
        raise ConfigError(f"{out / 'results.json'}: not an audit's results (no verdict)")
    verdict = summary["verdict"]
    clean = (summary["stages"].get("defense none") or {}).get("result")
    name = Path(summary["config"]["capture"]).name
    parts = [f"<h1>gradleak audit: {html.escape(name)}</h1>",
             "<div class='verdict'><h2>Verdict</h2><ul>"
             + "".join(f"<li>{html.escape(line)}</li>" for line in verdict["headline"])
             + "</ul></div>"]
    eval_dir = Path(clean["eval_dir"]) if clean else None
    if eval_dir and (eval_dir / "reconstructions.png").is_file():
        parts.append(figure(eval_dir / "reconstructions.png",
                            "Held-out frames: ground truth (top row) above each attack's "
                            "reconstruction from the gradients, no defense"))
    optimisation = (summary["stages"].get("optimisation baselines") or {}).get("result")
    if optimisation and (Path(optimisation["eval_dir"]) / "reconstructions.png").is_file():
        parts.append(figure(Path(optimisation["eval_dir"]) / "reconstructions.png",
                            "DLG and IG on their own clean frames: ground truth (top row) "
                            "above each reconstruction"))
    parts += [figure(path, caption) for path, caption in figures if path.is_file()]
    if clean:
        plot = out / "privacy_utility.png"
        attacks = {n: row for n, row in clean["methods"].items()
                   if row["kind"] not in ("reference", "control")}
        plot_privacy_utility(verdict["defenses"], attacks, verdict["stop_margin_db"], plot)
        parts.append(figure(plot, "Privacy–utility: each attack's PSNR gain over the mean "
                            "training image against what the defense costs the update (1 − its "
                            f"cosine to the clean one; dashed: {verdict['stop_margin_db']} dB, "
                            "the level counted as stopped)"))
    parts += ["<h2>Defenses</h2>",
              "<p>Every attack zero-shot under each defense; a defense stops them when every "
              f"frame attack is within {verdict['stop_margin_db']} dB of the mean image in "
              f"PSNR, {verdict['ssim_margin']} in SSIM and {verdict['lpips_margin']} in LPIPS, "
              "and every action read off the gradients is at chance "
              f"({verdict['chance']:.0%}).</p>",
              table(defense_rows(verdict), DEFENSE_COLUMNS)]
    for name, stage in summary["stages"].items():  # each defense's frames, the blind and
        folder = (stage.get("result") or {}).get("eval_dir")  # the defense-aware attack
        if name.startswith("defense ") and name != "defense none" and folder and \
                (Path(folder) / "reconstructions.png").is_file():
            parts.append(figure(Path(folder) / "reconstructions.png",
                                f"Under {name.removeprefix('defense ')}: ground truth (top "
                                "row) above each attack's reconstruction"))
    if clean:
        rows, columns = attack_by_defense(verdict, clean["methods"])
        parts += ["<h3>PSNR gain over the mean image (dB) / LPIPS, per attack and defense</h3>",
                  table(rows, columns),
                  "<h2>Attacks on the undefended stream</h2>",
                  f"<p>{html.escape(str(clean['windows']))} held-out windows of T = "
                  f"{html.escape(str(clean['window']))}; mean ± std over frames; the mean "
                  f"image is {html.escape(clean['mean_image_source'])}. LPIPS (AlexNet): "
                  f"{html.escape(str(clean['lpips']) + lpips_reads(clean))}.</p>",
                  table(table_rows(clean["methods"]),
                        table_columns(table_rows(clean["methods"])))]
        by_t, columns = psnr_by_t_rows(clean["methods"])
        parts += ["<h3>PSNR by position in the window</h3>", table(by_t, columns)]
        if (eval_dir / "psnr_by_t.png").is_file():
            parts.append(figure(eval_dir / "psnr_by_t.png", "PSNR by position in the window"))
    parts += ["<h2>Closed-form recovery</h2>",
              table(closed_form_rows(summary), ["what", "exact fraction", "steps"]),
              "<h2>The capture</h2>",
              table(capture_rows(summary["capture"]), ["field", "value"]),
              "<h2>Stages</h2>",
              table([{"stage": n, "seconds": s["seconds"], "skipped": s["skipped"]}
                     for n, s in summary["stages"].items()], ["stage", "seconds", "skipped"]),
              "<h2>Settings (audit.json)</h2>",
              f"<pre>{html.escape(json.dumps(summary['config'], indent=2))}</pre>",
              f"<p>{summary['minutes']} minutes of stages.</p>"]
    return write_page(out / "report.html", page(f"gradleak audit: {name}", parts))
