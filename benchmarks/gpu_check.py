"""The `paper` preset's TRACE on a GPU: throughput, inference time, and that the loss falls.

Run by `benchmarks/gpu_check.sh` on a machine with a GPU (under 10 minutes on one H200):

1. a random-init paper `cnn` victim at 84×84 captured on training and held-out scenes
   (float32, the wire format; on the CPU, as every capture);
2. TRACE at the paper preset (dense projection, width 2048, 4 encoder blocks, 6 decoder
   layers: about 2.3B parameters) fitted for --minutes in short epochs, with bf16 autocast
   (the fit's own, on CUDA) and DistributedDataParallel over NCCL (torchrun) when more than one
   GPU is present; the perceptual term is LPIPS-Alex when the VGG weights are not installed
   (they do not fit the device's transfer limit beside vizdoom);
3. inference: the autoregressive attack on held-out windows, ms per frame after a warm-up.

Prints JSON and writes benchmarks/results/gpu_check.json: the device, samples (windows) and
frames per second of training, the training loss per epoch and whether it fell, ms per frame.
On a machine without a GPU it refuses, unless --tiny (a CPU self-check of the script on a
miniature preset; its figures mean nothing and are not written to results/).

    python benchmarks/gpu_check.py [--minutes 4] [--train-steps 2048] [--work runs/gpu-check]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results" / "gpu_check.json"
TINY = ["--set", "env.doomnav.frame_size=32", "--set", "env.doomnav.max_steps=20",
        "--set", "env.train_maps=MAP01", "--set", "env.heldout_maps=MAP05",
        "--set", "env.max_regions_per_map=2", "--set", "attack.trace.encoder_width=32",
        "--set", "attack.trace.latent=32", "--set", "attack.trace.layers=1",
        "--set", "attack.trace.encoder_blocks=1", "--set", "attack.trace.image_channels=8",
        "--set", "attack.trace_fit.workers=0"]


def gradleak(*args: str, gpus: int = 1) -> None:
    """One gradleak command, through torchrun when several GPUs train together."""
    launcher = [sys.executable, "-m", "gradleak.cli"]
    if gpus > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={gpus}", "-m", "gradleak.cli"]
    subprocess.run([*launcher, *args], check=True)


def capture(work: Path, split: str, steps: int, flags: list[str]) -> Path:
    out = work / f"{split}.h5"
    if not out.exists():
        gradleak("capture", "--victim", "cnn", "--random-init", "--scenes", split, "--steps",
                 str(steps), "--out", str(out), "--quiet", *flags)
    return out


def fit(work: Path, train: Path, minutes: float, flags: list[str], gpus: int) -> dict[str, Any]:
    out = work / "trace"
    if out.exists():
        shutil.rmtree(out)  # the check's own folder: a second run measures afresh
    perceptual = "vgg" if lpips_weights_installed("vgg") else "alex"
    fit_flags = [f"attack.trace_fit.{key}={value}" for key, value in {
        "epochs": 1000, "max_train_windows": 256, "max_val_windows": 16,
        "time_limit_minutes": minutes, "time_limit_clock": "wall",
        "perceptual": perceptual}.items()]
    tick = time.perf_counter()
    gradleak("train-attacker", "--kind", "trace", "--data", str(train), "--out", str(out),
             "--quiet", *flags, *[part for flag in fit_flags for part in ("--set", flag)],
             gpus=gpus)
    meta = json.loads((out / "attacker.json").read_text())
    return {"dir": out, "meta": meta, "perceptual": perceptual,
            "seconds": time.perf_counter() - tick}


def lpips_weights_installed(net: str) -> bool:
    from gradleak.metrics.lpips import package_weights

    return package_weights(net) is not None


def throughput(meta: dict[str, Any], window: int) -> dict[str, Any]:
    """Windows and frames per second of training, from the per-epoch records (the first epoch
    left out when there are more: it holds the warm-up and cuDNN's autotuning)."""
    history = meta["history"]
    timed = history[1:] if len(history) > 1 else history
    windows = sum(meta["train_windows"] * h["epoch_fraction"] for h in timed)
    seconds = sum(h["train_minutes"] * 60 for h in timed)
    losses = [h["train_loss"] for h in history]
    return {"epochs": len(history), "train_windows_per_epoch": meta["train_windows"],
            "samples_per_s": windows / seconds, "frames_per_s": windows * window / seconds,
            "train_loss_by_epoch": losses,
            # the share of each epoch spent waiting for the loader (the GPU idle meanwhile:
            # every step reads its loss back)
            "data_wait_fraction_by_epoch": [h["data_wait_fraction"] for h in history],
            "loader_workers": meta["fit"]["workers"],
            # a factored capture's rows as stored, the full rows formed on the GPU (pinned
            # batches too): runs before had full rows, copied from pageable memory
            "compact_rows": meta.get("compact_rows", False),
            "loss_falls": len(losses) >= 2 and statistics.fmean(losses[-3:]) < losses[0],
            "world_size": meta.get("world_size", 1)}


def inference(attacker: Path, heldout: Path, windows: int, repeats: int = 5) -> dict[str, Any]:
    """ms per frame of the autoregressive attack on `windows` held-out windows at once."""
    from gradleak.capture.reader import CaptureFile
    from gradleak.training.checkpoint import load_attacker

    model, meta = load_attacker(attacker)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    window = int(meta["model"]["window"])
    with CaptureFile(heldout) as handle:
        rows = handle.observation(rows=slice(0, windows * window)).gradients
    gradients = torch.from_numpy(rows).float().view(windows, window, -1).to(device)
    times = []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                         enabled=device.type == "cuda"):
        for attempt in range(repeats + 1):
            synchronise(device)
            start = time.perf_counter()
            model.attack(gradients)
            synchronise(device)
            if attempt:  # the first call warms up
                times.append(time.perf_counter() - start)
    return {"windows": windows, "window": window,
            "ms_per_frame": 1000 * statistics.median(times) / (windows * window),
            "parameters": sum(p.numel() for p in model.parameters())}


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_text() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"device": f"cpu ({platform.machine()})", "gpus": 0}
    return {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
            "cuda": torch.version.cuda, "memory_gib": round(
                torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="TRACE's fit, wall clock")
    parser.add_argument("--train-steps", type=int, default=2048)
    parser.add_argument("--heldout-steps", type=int, default=256)
    parser.add_argument("--work", type=Path, default=Path("runs/gpu-check"))
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU self-check of this script on a miniature preset")
    args = parser.parse_args()
    device = device_text()
    if not device["gpus"] and not args.tiny:
        print("gpu_check: no CUDA device here; run it on a GPU machine (or --tiny to check "
              "the script itself on the CPU)", file=sys.stderr)
        return 2
    flags = ["--preset", "paper", *(TINY if args.tiny else [])]
    args.work.mkdir(parents=True, exist_ok=True)
    tick = time.perf_counter()
    train = capture(args.work, "train", args.train_steps, flags)
    heldout = capture(args.work, "heldout", args.heldout_steps, flags)
    capture_s = time.perf_counter() - tick
    fitted = fit(args.work, train, args.minutes, flags, max(1, device["gpus"]))
    window = int(fitted["meta"]["model"]["window"])
    result = {"benchmark": "gpu_check", **device, "torch": torch.__version__,
              "host": platform.node(), "tiny": args.tiny, "minutes": args.minutes,
              "train_steps": args.train_steps, "capture_seconds": capture_s,
              "perceptual": fitted["perceptual"], "bf16_autocast": bool(device["gpus"]),
              # the fit command's wall time: building the model, the normaliser, validation and
              # each epoch's checkpoint (weights and optimiser state) besides the epochs
              "fit_seconds": fitted["seconds"],
              "training": throughput(fitted["meta"], window),
              "inference": inference(fitted["dir"], heldout,
                                     windows=min(16, args.heldout_steps // window))}
    print(json.dumps(result, indent=2))
    if not args.tiny:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["training"]["loss_falls"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
