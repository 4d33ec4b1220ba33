"""The files of one evaluation: metrics.json, metrics.md, reconstructions.png, psnr_by_t.png,
samples.npz."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gradleak.io import atomic_path, write_json
from gradleak.report.plots import _save, picture, plt
from gradleak.report.tables import markdown_table

TABLE_COLUMNS = ["method", "MSE", "PSNR (dB)", "gain vs mean image", "SSIM", "LPIPS",
                 "action acc.", "hist. TV", "ms / frame", "parameters", "frames"]
OPTIONAL_COLUMNS = ("hist. TV",)  # shown only when some row has it (aggregated streams)
KIND_ORDER = {"training-free": 0, "learned": 1, "optimisation": 2, "rule": 3, "control": 4,
              "reference": 5}


def _pm(row: dict[str, Any], metric: str, digits: int) -> str | None:
    if metric not in row:
        return None
    return f"{row[metric]:.{digits}f} ± {row[metric + '_std']:.{digits}f}"


def ordered(methods: dict[str, dict[str, Any]]) -> list[str]:
    """Learned methods first, in the order they were given, then the optimisation baselines,
    the rule, and the references."""
    return sorted(methods, key=lambda n: (KIND_ORDER[methods[n]["kind"]],
                                          methods[n].get("order", 0)))


def table_rows(methods: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The paper's Table 1 layout."""
    rows = []
    for name in ordered(methods):
        row = methods[name]
        gain = row.get("psnr_gain_over_mean_image")
        mode = row.get("defense_mode")
        rows.append({
            "method": f"{name} [{mode}]" if mode else name, "MSE": _pm(row, "mse", 4),
            "PSNR (dB)": _pm(row, "psnr", 2),
            "gain vs mean image": None if gain is None or row["kind"] == "rule"
            else f"{gain:+.2f}",
            "SSIM": _pm(row, "ssim", 3), "LPIPS": _pm(row, "lpips", 3),
            "action acc.": (f"{100 * row['action_accuracy']:.1f}%"
                            if "action_accuracy" in row else None),
            "ms / frame": (f"{row['ms_per_frame']:.2f}" if row.get("ms_per_frame") and
                           row["kind"] != "reference" else None),
            "parameters": f"{row['parameters']:,}" if row.get("parameters") else None,
            "hist. TV": _pm(row, "histogram_tv", 3), "frames": row.get("frames") or None})
    return rows


def table_columns(rows: list[dict[str, Any]]) -> list[str]:
    return [c for c in TABLE_COLUMNS
            if c not in OPTIONAL_COLUMNS or any(r.get(c) is not None for r in rows)]


def psnr_by_t_rows(methods: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    steps = max(len(r.get("psnr_by_t", [])) for r in methods.values())
    columns = ["method"] + [f"t={t + 1}" for t in range(steps)]
    rows = [{"method": name, **{f"t={t + 1}": f"{v:.2f}" for t, v in
                                enumerate(methods[name].get("psnr_by_t", []))}}
            for name in ordered(methods) if methods[name].get("psnr_by_t")
            and methods[name]["kind"] != "rule"]
    return rows, columns


def utility_sentence(utility: dict[str, Any] | None) -> str:
    if not utility or utility.get("cosine") is None:
        return ""
    return (f"Utility: the defended mean gradient of an update ({utility['steps_per_update']} "
            f"steps, median over {utility['updates']}) has cosine {utility['cosine']:.3f} with "
            f"the clean one and relative norm error {utility['relative_norm_error']:.3f}.")


def markdown_report(result: dict[str, Any]) -> str:
    methods = result["methods"]
    by_t, columns = psnr_by_t_rows(methods)
    return "\n".join([
        f"# Reconstruction on held-out scenes ({result['windows']} windows of "
        f"T = {result['window']})", "",
        *([f"Defense: `{result['defense']['spec']}` applied to the held-out gradients. "
           "[adaptive]: the attacker was trained under the same defense; [zero-shot]: it was "
           "not. " + utility_sentence(result.get("utility")), ""]
          if result.get("defense") else []),
        *(["Aggregated stream: each observed gradient averages k steps of one episode. The "
           "image target is the block's last frame; action accuracy asks whether the predicted "
           "and true action histograms share their mode; hist. TV = ½ Σ_k |p̂_k − q_k|, with the "
           "uniform 1/K histogram as reference.", ""]
          if any("histogram_tv" in row for row in methods.values()) else []),
        markdown_table(table_rows(methods), table_columns(table_rows(methods))), "",
        "Mean ± std over frames. The two reference rows use no gradient: the mean training "
        "image, and each frame's own mean colour (an oracle: it reads the true frame). "
        "Optimisation baselines (DLG, IG) score only the frames of the first windows, and "
        "optimise the unobserved advantage and return jointly with the frame. "
        f"LPIPS: {result['lpips']}{lpips_reads(result)}.", "",
        "## PSNR by position in the window", "", markdown_table(by_t, columns), ""])


def plot_reconstructions(truth: np.ndarray, samples: dict[str, np.ndarray], path: Path,
                         sequences: int = 3) -> None:
    """For each sequence: ground truth, then one row per method that reconstructed it (the
    optimisation baselines invert fewer sequences), like the paper's Figure 4. Each row is one
    strip of its frames (a white gap between steps) on one axis: a grid of one axis per frame
    took seconds to draw and save per evaluation."""
    count = min(sequences, len(truth))
    labelled = [row for s in range(count) for row in
                [("ground truth", truth[s])] + [(name, frames[s]) for name, frames in
                                                samples.items() if s < len(frames)]]
    steps = truth.shape[1]
    figure, axes = plt.subplots(len(labelled), 1, figsize=(1.1 * steps + 1.6,
                                                           1.1 * len(labelled)), squeeze=False)
    for r, (label, frames) in enumerate(labelled):
        pictures = [picture(frame) for frame in frames]
        drawn, cmap = pictures[0]
        gap = np.full((drawn.shape[0], max(2, drawn.shape[1] // 16), *drawn.shape[2:]), 255,
                      np.uint8)
        strip = np.concatenate([p for image, _ in pictures for p in (image, gap)][:-1], axis=1)
        axis = axes[r, 0]
        axis.imshow(strip, cmap=cmap, vmin=0, vmax=255, interpolation="nearest")
        axis.set_yticks([])
        axis.set_ylabel(label, fontsize=6, rotation=0, ha="right", va="center")
        axis.set_xticks([] if r else [(t + 0.5) * drawn.shape[1] + t * gap.shape[1]
                                      for t in range(steps)])
        if r == 0:
            axis.set_xticklabels([f"t={t + 1}" for t in range(steps)], fontsize=7)
            axis.xaxis.tick_top()
            axis.tick_params(length=0)
        for side in axis.spines.values():
            side.set_visible(False)
    _save(figure, path)


def lpips_reads(result: dict[str, Any]) -> str:
    """How LPIPS read frames that are not one RGB frame each ('' for RGB)."""
    reads = result.get("lpips_reads", "RGB")
    return "" if reads == "RGB" or result.get("lpips") != "available" else f", on {reads}"


def plot_psnr_by_t(methods: dict[str, dict[str, Any]], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(5, 3.2))
    for name in ordered(methods):
        row = methods[name]
        if row.get("psnr_by_t") and row["kind"] != "rule":
            values = row["psnr_by_t"]
            style = "--" if row["kind"] == "reference" else "-"
            axis.plot(range(1, len(values) + 1), values, style, marker=".", label=name)
    axis.set_xlabel("position t in the window")
    axis.set_ylabel("PSNR (dB)")
    axis.legend(fontsize=7)
    _save(figure, path)


def write_evaluation(out: Path, result: dict[str, Any], methods: dict[str, Any],
                     truth: np.ndarray) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "metrics.json", result)
    with atomic_path(out / "metrics.md") as tmp:
        tmp.write_text(markdown_report(result))
    samples = {name: scores.samples for name, scores in methods.items()
               if scores.kind in ("learned", "training-free", "optimisation")
               or name.startswith("mean training")}
    plot_reconstructions(truth, samples, out / "reconstructions.png")
    save_samples(out / "samples.npz", truth, samples)
    plot_psnr_by_t(result["methods"], out / "psnr_by_t.png")


def save_samples(path: Path, truth: np.ndarray, samples: dict[str, np.ndarray]) -> None:
    """The pictured windows as arrays, so a figure across evaluations (an experiment's merge)
    is drawn from them: `truth` and `method_<i>` (S, T, H, W, 3) uint8, with `methods` naming
    them in order; plain arrays, readable with allow_pickle=False."""
    names = list(samples)
    with atomic_path(path) as tmp, tmp.open("wb") as handle:
        np.savez_compressed(handle, truth=truth, methods=np.array(names, dtype=str),
                            **{f"method_{i}": samples[name] for i, name in enumerate(names)})


def load_samples(path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(truth, method name → frames) as save_samples wrote them."""
    with np.load(path, allow_pickle=False) as data:
        names = [str(name) for name in data["methods"]]
        return data["truth"], {name: data[f"method_{i}"] for i, name in enumerate(names)}
