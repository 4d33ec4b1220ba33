"""`gradleak report RUN`: one self-contained report.html (tables and images inlined), offline.

An inline script counts the tables and the images that actually decoded and writes the counts
on <body> (data-tables, data-images-loaded), so a headless browser can check what it showed.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from gradleak.errors import ConfigError
from gradleak.io import atomic_path
from gradleak.report.evaluation import psnr_by_t_rows, table_columns, table_rows

FIGURES = (("reconstructions.png", "Ground truth above each method's reconstruction"),
           ("psnr_by_t.png", "PSNR by position in the window"),
           ("heldout_actions.png", "Actions read off single gradients"))

STYLE = """body{font-family:sans-serif;margin:2em;max-width:1100px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:.3em .6em;
font-size:.9em}th{background:#eee}img{max-width:100%;border:1px solid #ddd}
figure{margin:1.5em 0}figcaption{color:#555}"""

SCRIPT = """window.addEventListener('load',function(){var imgs=document.images,n=0;
for(var i=0;i<imgs.length;i++){if(imgs[i].complete&&imgs[i].naturalWidth>0)n++;}
document.body.setAttribute('data-images-loaded',n);
document.body.setAttribute('data-images',imgs.length);
document.body.setAttribute('data-tables',document.getElementsByTagName('table').length);});"""


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c) or '-'))}</td>"
                                    for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def write_report(run: Path) -> Path:
    metrics = run / "metrics.json"
    if not metrics.is_file():
        raise ConfigError(f"{run} has no metrics.json: run `gradleak evaluate ... --out {run}` "
                          "first")
    result = json.loads(metrics.read_text())
    methods = result["methods"]
    by_t, columns = psnr_by_t_rows(methods)
    parts = ["<h1>gradleak: reconstruction from per-step gradients</h1>",
             f"<p>{result['windows']} held-out windows of T = {result['window']} from "
             f"{html.escape(', '.join(result['data']))}. LPIPS: "
             f"{html.escape(result['lpips'])}.</p>",
             _table(table_rows(methods), table_columns(table_rows(methods))),
             "<p>Mean ± std over frames. The reference rows use no gradient; the mean-colour "
             "row is an oracle (it reads each true frame).</p>",
             "<h2>PSNR by position in the window</h2>", _table(by_t, columns)]
    parts += [_figure(run / name, caption) for name, caption in FIGURES if (run / name).is_file()]
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gradleak report</title>"
            f"<style>{STYLE}</style><script>{SCRIPT}</script></head><body>"
            + "\n".join(parts) + "</body></html>")
    out = run / "report.html"
    with atomic_path(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return out
