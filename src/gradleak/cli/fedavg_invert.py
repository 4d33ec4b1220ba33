"""`gradleak fedavg-invert`: invert recorded client updates (files the Flower strategy wrote)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gradleak.cli.common import common_flags, emit
from gradleak.errors import ConfigError


def parse_transform(text: str | None) -> Any:
    """'normalize:MEAN,STD' (one value, or one per channel each: 'normalize:0.5,0.5') or
    'none'; None keeps what the update file declares."""
    from gradleak.fedavg.invert import Normalize

    if text is None:
        return None
    if text == "none":
        return lambda images: images
    kind, _, values = text.partition(":")
    numbers = values.split(",")
    if kind != "normalize" or len(numbers) % 2 or not values:
        raise ConfigError(f"--input-transform {text!r}: expected none or normalize:MEAN,STD "
                          "(or normalize:M1,M2,M3,S1,S2,S3)")
    try:
        floats = [float(v) for v in numbers]
    except ValueError:
        raise ConfigError(f"--input-transform {text!r}: {values!r} are not numbers") from None
    half = len(floats) // 2
    return Normalize(tuple(floats[:half]), tuple(floats[half:]))


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"--shape {text!r}: expected C,H,W, e.g. 1,28,28")
    return shape


def load_truth(path: str | None) -> Any:
    from gradleak.fedavg.audit import Truth
    from gradleak.io import load_tensors

    if path is None:
        return None
    tensors = load_tensors(path, "--truth")
    images = tensors.get("images")
    if images is None or images.dim() != 4 or not images.is_floating_point():
        raise ConfigError(f"--truth {path}: expected a float tensor 'images' (N, C, H, W) in "
                          "[0, 1] (and optionally 'labels')")
    labels = tensors.get("labels")
    return Truth(images.float(), labels.long() if labels is not None else None)


def load_reference(spec: str | None) -> Any:
    """Auxiliary images for the mean-image row: a safetensors file with 'images', or one of
    the datasets `gradleak fedavg` reads (digits, photos, femnist:PATH, cifar100:PATH)."""
    from gradleak.fedavg.datasets import load_dataset
    from gradleak.io import load_tensors

    if spec is None:
        return None
    if spec.endswith(".safetensors"):
        images = load_tensors(spec, "--reference").get("images")
        if images is None or images.dim() != 4 or not images.is_floating_point():
            raise ConfigError(f"--reference {spec}: expected a float tensor 'images' "
                              "(M, C, H, W) in [0, 1]")
        return images.float()
    return load_dataset(spec).images


def run(args: argparse.Namespace) -> None:
    from gradleak.fedavg.audit import AuditOptions, audit_update, summarise
    from gradleak.fedavg.update_file import read_update
    from gradleak.io import check_output, write_json
    from gradleak.report.fedavg import write_fedavg_report
    from gradleak.victims.wrapped import resolve

    options = AuditOptions(methods=tuple(args.method), iterations=args.iters,
                           batchnorm=args.batchnorm, labels=args.labels, seed=args.seed,
                           threads=args.threads)
    options.check()
    transform, shape = parse_transform(args.input_transform), parse_shape(args.shape)
    truth = load_truth(args.truth)
    reference = load_reference(args.reference)
    if reference is not None and truth is None:
        raise ConfigError("--reference scores the mean image beside the attack, which needs "
                          "--truth too")
    if reference is not None and tuple(reference.shape[1:]) != tuple(truth.images.shape[1:]):
        raise ConfigError(f"--reference images are {tuple(reference.shape[1:])}, the truth's "
                          f"{tuple(truth.images.shape[1:])}")
    if options.labels == "known" and (truth is None or truth.labels is None):
        raise ConfigError("--labels known needs --truth FILE with a 'labels' tensor")
    declared = {k: v for k, v in (("lr", args.lr), ("epochs", args.epochs),
                                  ("batch", args.batch), ("steps", args.steps)) if v is not None}
    updates = [Path(u) for u in args.update]
    metas = [read_update(u).meta for u in updates]  # every file readable before any work
    model_ref = args.model or metas[0].get("model")
    if not model_ref:
        raise ConfigError("the update file names no model: pass --model package.module:Class")
    model_fn = resolve(model_ref, "--model")
    out = check_output(args.out, "--out", directory=True)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for path in updates:
        rows += [{**r, "update": path.stem} for r in audit_update(
            path, model_fn, options, out, truth=truth, reference=reference,
            input_transform=transform,
            declared=declared, shape=shape)]
    audit = {"format": "gradleak-fedavg-invert", "model": model_ref,
             "options": options.to_dict(), "summary": summarise(rows), "rows": rows}
    write_json(out / "audit.json", audit)
    write_fedavg_report(out, audit)
    lines = [f"{r['update']} {r['method']}: 1 − cos {r['l_sim']:.4f}"
             + (f", PSNR {r['psnr']:.2f} dB, SSIM {r['ssim']:.3f}" if "psnr" in r else "")
             + (f" (mean image {r['mean_image']['psnr']:.2f} dB)" if "mean_image" in r else "")
             + "".join(f"\n  warning: {w}" for w in r["warnings"]) for r in rows]
    emit(args, audit["summary"], "\n".join(lines) + f"\n-> {out / 'report.html'}")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from gradleak.fedavg.attacks import METHODS

    p = sub.add_parser("fedavg-invert", help="invert recorded FedAvg client updates (files "
                       "written by gradleak.integrations.flower)")
    common_flags(p)
    p.add_argument("--update", nargs="+", required=True, metavar="FILE",
                   help="update files (.safetensors) written by the Flower AuditStrategy or "
                   "gradleak.fedavg.write_update")
    p.add_argument("--model", help="package.module:Class building the model with no "
                   "arguments (its module loaded with --plugin); default: the file's")
    p.add_argument("--method", nargs="+", default=["sme"], choices=METHODS)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--batchnorm", choices=["train", "eval"],
                   help="the mode the client trained BatchNorm in (default: the file's)")
    p.add_argument("--input-transform", help="none, or normalize:MEAN,STD: how [0, 1] images "
                   "became the model's input (default: the file's)")
    p.add_argument("--shape", help="C,H,W of one image (default: the file's)")
    p.add_argument("--labels", choices=["infer", "known"], default="infer")
    p.add_argument("--truth", help="safetensors with 'images' (N, C, H, W) in [0, 1] and "
                   "optionally 'labels': scores the recovery (used for nothing else)")
    p.add_argument("--reference", help="auxiliary images whose mean is the reference row: "
                   "digits, photos, femnist:PATH, cifar100:PATH or a safetensors file with "
                   "'images' (needs --truth)")
    for name in ("epochs", "batch", "steps"):
        p.add_argument(f"--{name}", type=int, help=f"the client's {name} (overrides the file)")
    p.add_argument("--lr", type=float, help="the client's learning rate (overrides the file)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=run)
