"""`gradleak report RUN`: one self-contained report.html (tables and images inlined), offline.

An inline script counts the tables and the images that actually decoded, and the elements that
reach past the window's right edge, and writes the counts on <body> (data-tables,
data-images-loaded, data-cut-off), so a headless browser can check what it showed.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from gradleak.errors import ConfigError
from gradleak.io import atomic_path, check_output, read_json, write_json
from gradleak.report.scores import KIND_ORDER, psnr_by_t_rows, table_columns, table_rows

FIGURES = (("reconstructions.png", "Ground truth above each method's reconstruction"),
           ("psnr_by_t.png", "PSNR by position in the window"),
           ("heldout_actions.png", "Actions read off single gradients"))

STYLE = """body{font-family:sans-serif;margin:2em;max-width:1100px}
table{border-collapse:collapse;margin:1em 0;max-width:100%}td,th{border:1px solid #bbb;
padding:.3em .6em;font-size:.9em;overflow-wrap:anywhere}th{background:#eee}
img{max-width:100%;border:1px solid #ddd}figure{margin:1.5em 0}figcaption{color:#555}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f6f6f6;padding:.8em}
.verdict{border-left:6px solid #c0392b;background:#fdf2f0;padding:.6em 1.2em;font-size:1.05em}
.verdict li{margin:.35em 0}"""

SCRIPT = """window.addEventListener('load',function(){var imgs=document.images,n=0;
for(var i=0;i<imgs.length;i++){if(imgs[i].complete&&imgs[i].naturalWidth>0)n++;}
document.body.setAttribute('data-images-loaded',n);
document.body.setAttribute('data-images',imgs.length);
document.body.setAttribute('data-tables',document.getElementsByTagName('table').length);
var width=document.documentElement.clientWidth,cut=0,all=document.body.getElementsByTagName('*');
for(var j=0;j<all.length;j++){if(all[j].getBoundingClientRect().right>width+1)cut++;}
document.body.setAttribute('data-cut-off',cut);});"""


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c) or '-'))}</td>"
                                    for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


NUMBERS = ("mse", "mse_std", "psnr", "psnr_std", "ssim", "ssim_std", "lpips", "lpips_std",
           "action_accuracy", "histogram_tv", "histogram_tv_std", "ms_per_frame",
           "psnr_gain_over_mean_image", "frames", "parameters", "order")


def load_metrics(run: Path) -> dict[str, Any]:
    """metrics.json, checked field by field: the report formats numbers and lists names, so a
    hand-edited or truncated file is refused here, naming the field, not deep in a format."""
    metrics = run / "metrics.json"
    if not metrics.is_file():
        raise ConfigError(f"{run} has no metrics.json: run `gradleak evaluate ... --out {run}` "
                          "first")
    result = read_json(metrics, "evaluation metrics")
    methods = result.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise ConfigError(f"{metrics}: field 'methods' must be a non-empty object")
    for name, row in methods.items():
        if not isinstance(row, dict) or row.get("kind") not in KIND_ORDER:
            raise ConfigError(f"{metrics}: methods[{name!r}] must be an object with a 'kind' "
                              f"of {', '.join(KIND_ORDER)}")
        for key in NUMBERS:
            value = row.get(key)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                raise ConfigError(f"{metrics}: methods[{name!r}].{key} is {value!r}, expected "
                                  "a number")
        for metric in ("mse", "psnr", "ssim", "lpips"):
            if metric in row and f"{metric}_std" not in row:
                raise ConfigError(f"{metrics}: methods[{name!r}] has {metric} but no "
                                  f"{metric}_std")
        by_t = row.get("psnr_by_t", [])
        if not isinstance(by_t, list) or not all(isinstance(v, (int, float)) for v in by_t):
            raise ConfigError(f"{metrics}: methods[{name!r}].psnr_by_t must be a list of "
                              "numbers")
    data = result.get("data", [])
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise ConfigError(f"{metrics}: field 'data' must be a list of file names")
    return result


def page(title: str, parts: list[str]) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{STYLE}</style><script>{SCRIPT}</script></head><body>"
            + "\n".join(parts) + "</body></html>")


def write_page(out: Path, text: str) -> Path:
    out = check_output(out, "report")
    with atomic_path(out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return out


def write_report(run: Path) -> Path:
    result = load_metrics(run)
    methods = result["methods"]
    by_t, columns = psnr_by_t_rows(methods)
    parts = ["<h1>gradleak: reconstruction from per-step gradients</h1>",
             f"<p>{html.escape(str(result.get('windows')))} held-out windows of T = "
             f"{html.escape(str(result.get('window')))} from "
             f"{html.escape(', '.join(result.get('data', [])))}. LPIPS: "
             f"{html.escape(str(result.get('lpips')))}.</p>",
             table(table_rows(methods), table_columns(table_rows(methods))),
             "<p>Mean ± std over frames. The reference rows use no gradient; the mean-colour "
             "row is an oracle (it reads each true frame).</p>",
             "<h2>PSNR by position in the window</h2>", table(by_t, columns)]
    parts += [figure(run / name, caption) for name, caption in FIGURES if (run / name).is_file()]
    return write_page(run / "report.html", page("gradleak report", parts))


COMPARISON_MARKER = "comparison.json"  # says: the report.html beside it is a comparison's


def run_labels(runs: list[Path]) -> list[str]:
    """Each run's folder name, or its whole path where two names collide."""
    names = [run.name or str(run) for run in runs]
    return [name if names.count(name) == 1 else str(run) for name, run in zip(names, runs,
                                                                             strict=True)]


def write_comparison(runs: list[Path], out: Path) -> Path:
    """Several evaluations side by side: one table (each run's methods, the Table 1 columns)
    and one figure (PSNR per method, a bar per run), in OUT/report.html."""
    from gradleak.report.plots import plot_grouped_bars

    if len(set(map(Path.resolve, runs))) != len(runs):
        raise ConfigError("report: the same evaluation is named twice")
    results = [load_metrics(run) for run in runs]  # every run checked before anything is written
    out = check_output(out, "--out", directory=True)
    marker = out / COMPARISON_MARKER
    taken = [name for name in ("report.html", "comparison.png") if (out / name).exists()]
    if taken and not marker.is_file():
        raise ConfigError(f"--out {out} already holds {' and '.join(taken)} from something "
                          "else than a comparison: choose a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    labels = run_labels(runs)
    write_json(marker, {"format": "gradleak-comparison", "runs": [str(run) for run in runs]})
    rows = [{"run": label, **row} for label, result in zip(labels, results, strict=True)
            for row in table_rows(result["methods"])]
    columns = ["run", *table_columns(rows)]
    psnr = {label: {name: row["psnr"] for name, row in result["methods"].items()
                    if row.get("psnr") is not None}
            for label, result in zip(labels, results, strict=True)}
    plot_grouped_bars(psnr, out / "comparison.png")  # methods on x, a bar per run
    parts = ["<h1>gradleak: evaluations side by side</h1>",
             "<p>" + "; ".join(f"{html.escape(label)}: {html.escape(str(r.get('windows')))} "
                               f"windows of T = {html.escape(str(r.get('window')))}, defense "
                               f"{html.escape(str((r.get('defense') or {}).get('spec', 'none')))}"
                               for label, r in zip(labels, results, strict=True)) + "</p>",
             table(rows, columns),
             figure(out / "comparison.png", "PSNR of each method, a bar per evaluation")]
    return write_page(out / "report.html", page("gradleak comparison", parts))
