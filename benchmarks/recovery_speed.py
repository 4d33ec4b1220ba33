"""Recovery speed: the training-free attack's two parts per frame on both victim sizes, the peak
memory of `gradleak closed-form` as rows grow, and a learned attacker's inference and data wait.

- the conv-stack recursion (batched over the frames) and the frame solve, ms per frame,
  medians of --repeats, on `exact_frames.py`'s float32 held-out captures of cnn-small at 64×64
  and the paper's cnn at 84×84 (random init and PPO; made here when missing, as that script
  makes them);
- `gradleak closed-form` on --analytic-rows counts of a capture, each in a fresh process: peak
  resident memory (getrusage) and seconds;
- training windows a second from the paper cnn's attacker-training capture (factored float32, 30
  MB a window) through a DataLoader with 0, 1 and 2 workers, batches read into one tensor
  against window by window (`loader_rates`);
- with --attacker DIR (a TRACE run) and --data CAPTURE: inference ms per frame at batch 1 and
  16 windows, and the share of each epoch its fit spent waiting for data (from its history);
  without, the inference of the cpu-bench TRACE untrained (the same arithmetic) on the
  cnn-small capture, beside the earlier fit's data wait.

Prints JSON and writes benchmarks/results/recovery_speed.{json,md}.

    python benchmarks/recovery_speed.py [--work runs/exact-frames] [--attacker DIR --data H5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.capture.reader import CaptureFile
from gradleak.io import atomic_path
from gradleak.report.tables import markdown_table

import exact_frames
import exact_speed
from exact_frames import Case

RESULTS = Path(__file__).parent / "results" / "recovery_speed.json"
TARGETS_MS = {"cnn-small": 20.0, "cnn": 60.0}  # issue 22: the recursion per frame
SOLVE_TARGET_MS = 1000.0


def training_free(args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = [Case("cnn-small 64×64, random init", "cnn-small", "cpu-bench", True),
             Case("cnn-small 64×64, PPO", str(args.ppo_small), "cpu-bench", False),
             *exact_frames.paper_cases(args.ppo_cnn)]
    seconds: dict[str, float] = {}
    exact_speed.timed_parts(seconds)
    rows = []
    for case in cases:
        row = exact_speed.measure(case, args, seconds)
        target = TARGETS_MS[case.name.split()[0]]
        row["recursion_target_ms"] = target
        rows.append(row)
    return rows


def analytic_memory(capture: Path, counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for count in counts:
        code = ("import resource, sys, time\nfrom gradleak.cli import main\nstart = time.time()\n"
                f"main(['analytic', {str(capture)!r}, '--max-rows', '{count}', '--quiet'])\n"
                "print(time.time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.split()
        rows.append({"rows": count, "seconds": float(out[-2]),
                     "peak_rss_gb": int(out[-1]) * 1024 / 1e9})
    return rows


def learned(attacker: Path, data: Path, repeats: int) -> dict[str, Any]:
    from gradleak.training.checkpoint import load_attacker

    model, meta = load_attacker(attacker)
    window = int(meta["model"]["window"])
    waits = [h["data_wait_fraction"] for h in meta.get("history", [])
             if "data_wait_fraction" in h]
    from gradleak.attacks.trace import Trace

    anatomy = {"one_window": one_window_anatomy(model, data, window, repeats)} \
        if isinstance(model, Trace) else {}
    return {"attacker": str(attacker), **inference(model, data, window, repeats), **anatomy,
            "data_wait_fraction_by_epoch": waits, "workers": meta["fit"].get("workers")}


def untrained_inference(data: Path, repeats: int) -> dict[str, Any]:
    """The cpu-bench TRACE's inference, untrained: its weights change none of the arithmetic,
    and a fitted one takes an hour to make."""
    from gradleak.attacks.encoders import ImageDecoder
    from gradleak.attacks.trace import Trace
    from gradleak.presets import load_preset

    with CaptureFile(data) as capture:
        dimension = int(capture.attrs["gradient_dim"])
    config = replace(load_preset("cpu-bench").attack.trace, gradient_dim=dimension)
    torch.manual_seed(0)
    model = Trace(config).eval()
    result = {"attacker": "cpu-bench TRACE, untrained"}
    # the decoder's two memory layouts side by side, alternating, in this one process
    times: dict[str, list[dict[str, Any]]] = {"channels_last": [], "contiguous": []}
    for _ in range(repeats):
        for name, layout in (("channels_last", torch.channels_last),
                             ("contiguous", torch.contiguous_format)):
            ImageDecoder.memory_format = layout
            times[name].append(inference(model, data, config.window, 1))
    ImageDecoder.memory_format = torch.channels_last
    result["one_window"] = one_window_anatomy(model, data, config.window, repeats)
    for batch in (1, 16):
        key = f"inference_ms_per_frame_batch_{batch}"
        for name, runs in times.items():
            median = statistics.median(run[key] for run in runs)
            result[key if name == "channels_last" else f"{key}_contiguous_decoder"] = median
    return {**times["channels_last"][0], **result}


def windows_of(data: Path, window: int, count: int = 16) -> torch.Tensor:
    """The first `count` windows of `data`'s gradients, (count, window, d) float32."""
    with CaptureFile(data) as capture:
        rows = min(len(capture) // window, count) * window
        return torch.from_numpy(capture.observation(
            rows=slice(0, rows)).gradients).float().view(-1, window, capture.attrs["gradient_dim"])


def median_ms(run: Callable[[], Any], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def one_window_anatomy(model: Any, data: Path, window: int, repeats: int) -> dict[str, Any]:
    """Why one window costs more a frame than a batch: the decoding chain against the sum of its
    parts each timed alone (run back to back, a part's weights stay in the caches; in the chain
    each step reads every block's and the decoder's weights again), and the whole model in
    bfloat16 (half the bytes; its frames' largest difference from float32's)."""
    import copy

    gradients = windows_of(data, window, 1)
    rounds = max(repeats, 5)
    with torch.no_grad():
        frames, _ = model.attack(gradients)
        z = model.encode_gradients(gradients)
        context = model.start.expand(1, -1)[:, None]
        x = model._through_blocks(z[:, :1], context, 0, [[] for _ in model.blocks])
        parts = {  # ms a frame: the encoder runs once a window, the frame encoder T - 1 times
            "gradient_encoder": median_ms(lambda: model.encode_gradients(gradients), rounds)
            / window,
            "blocks": median_ms(lambda: model._through_blocks(
                z[:, :1], context, 0, [[] for _ in model.blocks]), rounds),
            "read_out": median_ms(lambda: model._read_out(x), rounds),
            "frame_encoder": median_ms(lambda: model.image_encoder(frames[:, 0]), rounds)
            * (window - 1) / window}
        half = copy.deepcopy(model).to(torch.bfloat16)
        chain, bf16 = [], []
        for _ in range(rounds):  # alternating, so the host's drift falls on both
            chain.append(median_ms(lambda: model.attack(gradients), 1) / window)
            bf16.append(median_ms(lambda: half.attack(gradients.bfloat16()), 1) / window)
        difference = (half.attack(gradients.bfloat16())[0].float() - frames).abs().max()
    return {"chain_ms_per_frame": statistics.median(chain),
            "parts_alone_ms_per_frame": parts,
            "parts_alone_sum_ms_per_frame": sum(parts.values()),
            "bfloat16_ms_per_frame": statistics.median(bf16),
            "bfloat16_max_frame_difference": float(difference)}


def inference(model: torch.nn.Module, data: Path, window: int, repeats: int
              ) -> dict[str, Any]:
    """ms per frame of `model.attack` on 1 and 16 windows of `data`, medians of `repeats`."""
    gradients = windows_of(data, window)
    result: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters()),
                              "window": window}
    with torch.no_grad():
        for batch in (1, 16):
            windows = gradients[torch.arange(batch) % len(gradients)]
            result[f"inference_ms_per_frame_batch_{batch}"] = \
                median_ms(lambda: model.attack(windows), repeats) / (batch * window)
    return result


class _WindowByWindow:
    """`WindowDataset` as a DataLoader read it before batches were read into one tensor: each
    window its own arrays, then stacked (the DataLoader asks per window without __getitems__)."""

    __getitems__ = None

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return self.data[index]


def loader_rates(capture: Path, repeats: int, batches: int = 10) -> dict[str, Any]:
    """Training windows a second a DataLoader delivers (16 a batch, `batches` shuffled batches
    an epoch) from `capture`, with 0, 1 and 2 worker processes: each batch read into one tensor
    (`WindowDataset.__getitems__`, the default) against window by window and stacked, and
    compact (the rows as stored, as a fit on a GPU reads them, the full rows formed there),
    alternating epoch by epoch; medians of `repeats` epochs after a warm-up one. Beside them,
    the bytes a window takes each way and what forming a compact batch's full rows costs
    here, on the CPU (on a GPU it is one write of the full rows in its memory)."""
    from torch.utils.data import DataLoader, SubsetRandomSampler

    from gradleak.training.data import WindowDataset, collate

    data = WindowDataset([capture], window=8)
    compact = WindowDataset([capture], window=8, compact=True)
    subset = np.random.default_rng(0).permutation(len(data))[:16 * batches].tolist()
    result: dict[str, Any] = {"capture": capture.name, "window": 8, "batch": 16,
                              "row_mb": 4e-6 * data.gradient_dim,
                              **compact_costs(compact, subset[:16], repeats)}
    sources = {"batch_read": data, "window_by_window": _WindowByWindow(data),
               "compact": compact}
    for workers in (0, 1, 2):
        rates: dict[str, list[float]] = {name: [] for name in sources}
        for epoch in range(repeats + 1):
            for name, source in sources.items():
                # workers started afresh each epoch (their start counts) and gone at its end:
                # with persistent loaders kept alive, what ran after them came out 3-5x slow
                # (TRACE's inference 40 against 8 ms a frame run alone)
                loader = DataLoader(source, batch_size=16, collate_fn=collate,
                                    sampler=SubsetRandomSampler(
                                        subset, torch.Generator().manual_seed(epoch)),
                                    num_workers=workers)
                start = time.perf_counter()
                windows = sum(len(batch.actions) for batch in loader)
                if epoch:
                    rates[name].append(windows / (time.perf_counter() - start))
        for name, values in rates.items():
            result[f"windows_per_s_{name}_{workers}_workers"] = statistics.median(values)
    return result


def compact_costs(compact: Any, indices: list[int], repeats: int) -> dict[str, Any]:
    """MB a window as full rows and compact, and ms a window to form the full rows of a batch
    of compact ones on this CPU (medians of `repeats`)."""
    from gradleak.training.data import collate

    rows = collate(compact.__getitems__(indices)).observed.gradients
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        full = rows.full()
        times.append(time.perf_counter() - start)
    per_window = len(indices)
    return {"full_mb_per_window": full.numel() * 4e-6 / per_window,
            "compact_mb_per_window": (rows.stored.numel() * rows.stored.element_size()
                                      + rows.factors.numel() * rows.factors.element_size())
            / 1e6 / per_window,
            "forming_full_rows_ms_per_window_cpu": 1e3 * statistics.median(times[1:])
            / per_window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("runs/exact-frames"))
    parser.add_argument("--steps", type=int, default=64, help="of each held-out capture")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ppo-cnn", type=Path, default=Path("runs/victims/cnn84-ppo"))
    parser.add_argument("--ppo-small", type=Path, default=Path("runs/victims/small64-ppo"))
    parser.add_argument("--analytic-rows", type=int, nargs="+", default=[64, 256, 768])
    parser.add_argument("--attacker", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=None)
    args = parser.parse_args()
    for path in (args.ppo_cnn, args.ppo_small):
        if not path.is_dir():
            parser.error(f"{path} is not a victim checkpoint directory: train it first (see "
                         "benchmarks/exact_frames.py)")
    if (args.attacker is None) != (args.data is None):
        parser.error("--attacker and --data go together")
    torch.set_num_threads(2)
    result: dict[str, Any] = {
        "benchmark": "recovery_speed", "frames": args.frames, "repeats": args.repeats,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}, no GPU",
        "training_free": training_free(args)}
    analytic_capture = exact_frames.capture(exact_frames.paper_cases(args.ppo_cnn)[1],
                                            "float32", 64, args.work)
    big = args.work / "attacker-train-cnn84-ppo-768.h5"
    used = big if big.exists() else analytic_capture
    with CaptureFile(used) as capture:
        result["analytic_capture"] = f"{used.name} ({len(capture)} rows)"
    result["analytic"] = analytic_memory(used, args.analytic_rows)
    if big.exists():  # a factored float32 capture of the paper cnn: 30 MB a window
        result["loader"] = loader_rates(big, args.repeats)
    if args.attacker is not None:
        result["learned"] = learned(args.attacker, args.data, args.repeats)
    else:  # the same architecture untrained; the data wait is the earlier fit's, so marked
        small = exact_frames.capture(Case("cnn-small 64×64, random init", "cnn-small",
                                          "cpu-bench", True), "float32", args.steps, args.work)
        result["learned"] = untrained_inference(small, args.repeats)
        earlier = json.loads(RESULTS.read_text()).get("learned", {}) if RESULTS.exists() else {}
        if earlier.get("data_wait_fraction_by_epoch"):
            result["learned"].update(
                data_wait_fraction_by_epoch=earlier["data_wait_fraction_by_epoch"],
                workers=earlier.get("workers"), data_wait_from_an_earlier_run=True)
    print(json.dumps(result, indent=2))
    write(result)


def write(result: dict[str, Any]) -> None:
    with atomic_path(RESULTS) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    table = [{"victim": r["victim"],
              "recursion ms/frame": f"{r['observed_conv_inputs_ms_per_frame']:.0f} "
                                    f"(target {r['recursion_target_ms']:.0f})",
              "frame solve ms/frame": f"{r['solve_frames_ms_per_frame']:.0f} "
                                      f"(target {SOLVE_TARGET_MS:.0f})",
              "whole attack ms/frame": f"{r['total_ms_per_frame']:.0f}"}
             for r in result["training_free"]]
    memory = [{"rows": r["rows"], "peak RSS (GB)": f"{r['peak_rss_gb']:.2f}",
               "seconds": f"{r['seconds']:.0f}"} for r in result["analytic"]]
    text = ["# Recovery speed (`benchmarks/recovery_speed.py`)", "",
            f"{result['frames']} held-out float32 steps per victim, medians of "
            f"{result['repeats']}; {result['machine']}.", "",
            markdown_table(table, list(table[0])), "",
            f"`gradleak closed-form` on {result['analytic_capture']} (each count in a fresh "
            "process):", "", markdown_table(memory, list(memory[0]))]
    if "learned" in result:
        learned_row = result["learned"]
        waits = learned_row.get("data_wait_fraction_by_epoch", [])
        text += ["", f"TRACE ({learned_row['parameters']:,} parameters, T = "
                 f"{learned_row['window']}): inference "
                 f"{learned_row['inference_ms_per_frame_batch_16']:.2f} ms per frame at 16 "
                 f"windows a batch, {learned_row['inference_ms_per_frame_batch_1']:.2f} at one; "
                 "its fit waited for data "
                 + (f"{100 * max(waits):.1f}% of an epoch at most ({learned_row['workers']} "
                    "loader worker(s))" if waits else "(not recorded by that fit)") + "."
                 + (" Measured by an earlier run (no attacker given to this one)."
                    if learned_row.get("from_an_earlier_run") else "")
                 + (f" Inference timed on the {learned_row['attacker']} (the same arithmetic "
                    "as a fitted one); the data wait is an earlier fit's."
                    if learned_row.get("data_wait_from_an_earlier_run") else "")
                 + (" With the decoder's convs on contiguous (not channels-last) memory, "
                    "alternating with it in the same run: "
                    f"{learned_row['inference_ms_per_frame_batch_16_contiguous_decoder']:.2f} "
                    f"and {learned_row['inference_ms_per_frame_batch_1_contiguous_decoder']:.2f}."
                    if "inference_ms_per_frame_batch_16_contiguous_decoder" in learned_row
                    else "")]
        if "one_window" in learned_row:
            one = learned_row["one_window"]
            parts = ", ".join(f"{name.replace('_', ' ')} {ms:.2f}"
                              for name, ms in one["parts_alone_ms_per_frame"].items())
            text += ["", f"One window at a time: {one['chain_ms_per_frame']:.2f} ms a frame in "
                     "the decoding chain, against "
                     f"{one['parts_alone_sum_ms_per_frame']:.2f} for its parts each run alone "
                     f"({parts}), whose weights then stay in the caches; the whole model in "
                     f"bfloat16 {one['bfloat16_ms_per_frame']:.2f} (frames within "
                     f"{one['bfloat16_max_frame_difference']:.4f} of float32's)."]
    if "loader" in result:
        loader = result["loader"]
        text += ["", f"Training windows a second from {loader['capture']} ({loader['window']} "
                 f"rows of {loader['row_mb']:.1f} MB a window, {loader['batch']} a batch), each "
                 "batch read into one tensor against window by window (each window its own "
                 "arrays, then stacked), alternating epoch by epoch: "
                 + "; ".join(f"{workers} worker(s) "
                             f"{loader[f'windows_per_s_batch_read_{workers}_workers']:.0f} "
                             f"against "
                             f"{loader[f'windows_per_s_window_by_window_{workers}_workers']:.0f}"
                             for workers in (0, 1, 2)) + "."]
        if "windows_per_s_compact_0_workers" in loader:
            text += ["", "Compact, as a fit on a GPU reads them (the rows as stored, "
                     f"{loader['compact_mb_per_window']:.1f} MB a window against "
                     f"{loader['full_mb_per_window']:.1f}; the full rows formed where they are "
                     "used): "
                     + "; ".join(f"{workers} worker(s) "
                                 f"{loader[f'windows_per_s_compact_{workers}_workers']:.0f}"
                                 for workers in (0, 1, 2))
                     + f" windows a second; forming the full rows here, on the CPU, costs "
                     f"{loader['forming_full_rows_ms_per_window_cpu']:.1f} ms a window."]
    with atomic_path(RESULTS.with_suffix(".md")) as tmp:
        tmp.write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
