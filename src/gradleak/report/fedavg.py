"""report.html of a FedAvg audit (the Flower strategy, or `gradleak fedavg-invert`): the verdict
first, then per-method and per-update tables, then each client's pictures."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradleak.report.html import figure, page, table, write_page


def _fixed(value: Any, digits: int) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def common_norm(rows: Sequence[dict[str, Any]]) -> float | None:
    """The norm all audited updates share (to 1e-4), as a clipping mod leaves them."""
    norms = {r["update"]: r["update_norm"] for r in rows if "update_norm" in r}
    if len(norms) < 2:
        return None
    low, high = min(norms.values()), max(norms.values())
    return high if high > 0 and (high - low) <= 1e-4 * high else None


def counted(entry: dict[str, Any], key: str) -> str | None:
    """"k of n" images, where the entry was scored against the truth."""
    if key not in entry or "images" not in entry:
        return None
    return f"{entry[key]} of {entry['images']}"


def scores_text(scores: dict[str, float]) -> str:
    return ", ".join([f"PSNR {scores['psnr']:.2f} dB"] + [f"{k.upper()} {scores[k]:.3f}"
                                                         for k in ("ssim", "lpips") if k in scores])


def against(entry: dict[str, Any]) -> str:
    """The method set against the mean image on every metric (`metrics.leak`), and each image's
    own mean colour beside it."""
    if "mean_image" not in entry:
        return ""
    found = entry.get("leaks", [])
    verdict = ("beyond it on " + ", ".join(found) + ": the update leaks more than the data's "
               "average") if found else "at it on PSNR, SSIM and LPIPS: no better than the " \
        "average image"
    colour, labels = entry.get("mean_colour"), entry.get("class_mean")
    said = (f"; each used label's mean auxiliary image (the labels alone, no optimisation) "
            f"scores {scores_text(labels)}, " + (
                "beyond the mean image on " + ", ".join(entry["class_mean_leaks"])
                if entry.get("class_mean_leaks") else "no better than the mean image")
            if labels else "")
    return (f" against the mean image's {scores_text(entry['mean_image'])} (no gradient), "
            f"{verdict}{said}" + (f"; each image's own mean colour (an oracle) scores "
                                  f"{scores_text(colour)}" if colour else ""))


def strongest_per_update(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scored update, the row of the method closest to the truth (highest PSNR)."""
    best: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for row in rows:
        if "psnr" not in row:
            continue
        key = (row.get("round"), row.get("node_id"), row.get("update"))
        if key not in best or row["psnr"] > best[key]["psnr"]:
            best[key] = row
    return [best[key] for key in sorted(best, key=str)]


def verdict_lines(audit: dict[str, Any]) -> list[str]:
    rows, summary = audit.get("rows", []), audit.get("summary", {})
    if not rows:
        return ["No client update was audited (see failures below)."]
    lines = [f"{len({r['update'] for r in rows})} client update(s) audited with "
             f"{', '.join(summary)}."]
    if audit.get("options", {}).get("labels") == "known":
        lines.append("Labels known: an oracle. The clients' true labels were handed to the "
                     "attacks; a server infers them from the output bias (labels='infer').")
    for method, entry in summary.items():
        if "psnr" in entry:
            lines.append(f"{method}: {entry['psnr']:.2f} dB, SSIM {entry['ssim']:.3f}"
                         + (f", LPIPS {entry['lpips']:.3f}" if "lpips" in entry else "")
                         + against(entry) + ".")
            if "images" in entry:
                lines.append(f"{method}: {entry['exact']} of {entry['images']} images came back "
                             "exactly (≥ 40 dB)" + (
                                 f", {entry['above_mean_image']} closer than the mean image on "
                                 "every metric" if "above_mean_image" in entry else "") + ".")
        else:
            lines.append(f"{method}: matching loss {entry['l_sim']:.4f} (no truth to score).")
        if "labels_inferred_right" in entry:
            lines.append(f"{method}: labels inferred from the output bias, "
                         f"{entry['labels_inferred_right']} of {entry['labels_inferred_of']} "
                         "right.")
        if entry.get("poor_fit"):
            lines.append(f"{method}: {entry['poor_fit']} update(s) carry a warning (poor fit "
                         "or a BatchNorm mode the running statistics contradict).")
    strongest = strongest_per_update(rows)
    if strongest:
        lines.append("Strongest method per client update: " + "; ".join(
            f"{r.get('update')}: {r['method']} {r['psnr']:.2f} dB"
            + (f", {r['exact']} of {r['images']} exact" if "exact" in r else "")
            for r in strongest) + ".")
    norm = common_norm(rows)
    if norm is not None:
        lines.append(f"Every update has the same norm, {norm:.4g}: a clipping bound. Clipping "
                     "rescales an update without turning it, and these attacks match its "
                     "direction, so it protects only with noise added before the server sees "
                     "each update.")
    return lines


def write_fedavg_report(out: Path, audit: dict[str, Any]) -> Path:
    summary = audit.get("summary", {})
    method_rows = [{"method": m, "updates": e["updates"], "PSNR": _fixed(e.get("psnr"), 2),
                    "SSIM": _fixed(e.get("ssim"), 3), "LPIPS": _fixed(e.get("lpips"), 3),
                    "mean image PSNR": _fixed(e.get("mean_image_psnr"), 2),
                    "gain (dB)": _fixed(e.get("psnr_gain_over_mean_image"), 2),
                    "exact": counted(e, "exact"),
                    "beat the mean image": counted(e, "above_mean_image"),
                    "1 − cos": _fixed(e["l_sim"], 4), "s per update": _fixed(e["seconds"], 1)}
                   for m, e in summary.items()]
    update_rows = [{"round": r["round"], "node": r["node_id"], "N": r["num_examples"],
                    "method": r["method"], "PSNR": _fixed(r.get("psnr"), 2),
                    "SSIM": _fixed(r.get("ssim"), 3), "LPIPS": _fixed(r.get("lpips"), 3),
                    "exact": counted(r, "exact"),
                    "beat the mean image": counted(r, "above_mean_image"),
                    "labels": ("inferred" if r["labels_inferred"] else "given")
                    + (f", {r['labels_right']}/{r['num_examples']} right"
                       if "labels_right" in r else ""),
                    "1 − cos": _fixed(r["l_sim"], 4),
                    "‖w0 − w_T‖": _fixed(r.get("update_norm"), 4),
                    "warnings": "; ".join(r["warnings"])}
                   for r in sorted(audit.get("rows", []), key=lambda r: (
                       r["round"], r["node_id"], -(r.get("psnr") or 0.0)))]
    parts = [f"<h1>FedAvg audit: {html.escape(str(audit.get('model', 'model')))}</h1>",
             "<div class='verdict'><ul>" + "".join(f"<li>{html.escape(line)}</li>"
                                                    for line in verdict_lines(audit))
             + "</ul></div>",
             "<h2>Per method</h2>",
             table(method_rows, ["method", "updates", "PSNR", "SSIM", "LPIPS",
                                 "mean image PSNR", "gain (dB)", "exact",
                                 "beat the mean image", "1 − cos", "s per update"]),
             "<h2>Per client update</h2>",
             table(update_rows, ["round", "node", "N", "method", "PSNR", "SSIM", "LPIPS",
                                 "exact", "beat the mean image", "labels", "1 − cos",
                                 "‖w0 − w_T‖", "warnings"])]
    if audit.get("failures"):
        parts += ["<h2>Failures</h2>", table(audit["failures"], ["round", "node_id", "error"])]
    for row in audit.get("rows", []):
        picture = out / Path(row["update"]).parent / row["picture"] if row.get("picture") \
            else None
        if picture is not None and picture.is_file():
            parts.append(figure(picture, f"round {row['round']}, node {row['node_id']}, "
                                         f"{row['method']}: private (top), recovered (bottom)"))
    settings = {k: audit.get(k) for k in ("options", "every", "shape")}
    parts += ["<h2>Settings</h2>", f"<pre>{html.escape(json.dumps(settings, indent=2))}</pre>"]
    return write_page(out / "report.html", page("gradleak FedAvg audit", parts))
