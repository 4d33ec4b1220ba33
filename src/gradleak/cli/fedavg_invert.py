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


def load_reference(spec: str | None) -> tuple[Any, Any]:
    """Auxiliary images for the mean-image row, and their labels where known (for the
    class-mean row): a safetensors file with 'images' (and optionally 'labels'), or one of the
    datasets `gradleak fedavg` reads (digits, photos, femnist:PATH, cifar100:PATH)."""
    from gradleak.fedavg.datasets import load_dataset
    from gradleak.io import load_tensors

    if spec is None:
        return None, None
    if spec.endswith(".safetensors"):
        tensors = load_tensors(spec, "--reference")
        images, labels = tensors.get("images"), tensors.get("labels")
        if images is None or images.dim() != 4 or not images.is_floating_point():
            raise ConfigError(f"--reference {spec}: expected a float tensor 'images' "
                              "(M, C, H, W) in [0, 1]")
        if labels is not None and (labels.is_floating_point() or labels.dim() != 1
                                   or len(labels) != len(images)):
            raise ConfigError(f"--reference {spec}: 'labels' must be integers, one per image "
                              f"({len(images)})")
        return images.float(), None if labels is None else labels.long()
    data = load_dataset(spec)
    return data.images, data.labels


def update_labels(paths: list[Path]) -> list[str]:
    """One name per update for its rows and files in the flat --out: the file's stem, or with
    its folder where stems repeat (Flower's round-001/node-7, round-002/node-7)."""
    resolved = [path.resolve() for path in paths]
    twice = sorted({str(p) for p in paths if resolved.count(p.resolve()) > 1})
    if twice:
        raise ConfigError(f"--update names {twice[0]} twice")
    labels = [path.stem for path in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{path.parent.name}-{path.stem}" for path in paths]
    if len(set(labels)) < len(labels):
        clash = next(p for p, label in zip(paths, labels) if labels.count(label) > 1)
        raise ConfigError(f"--update: {clash} and another file share the name "
                          f"{clash.parent.name}/{clash.name}: invert them in separate runs")
    return labels


def run(args: argparse.Namespace) -> None:
    from torch import nn

    from gradleak.fedavg.audit import AuditOptions, audit_update, summarise
    from gradleak.fedavg.forward import identity
    from gradleak.fedavg.invert import (
        Training,
        counted_steps,
        inference_gap,
        replay_config,
        split_state,
    )
    from gradleak.fedavg.update_file import (
        check_meta,
        read_meta,
        read_update,
        transform_from_dict,
    )
    from gradleak.fedavg.walk import plan_walk
    from gradleak.io import check_output, write_json
    from gradleak.names import TRAINING_FREE
    from gradleak.report.fedavg import write_fedavg_report
    from gradleak.victims.factories import MODEL_FACTORIES, find

    options = AuditOptions(methods=tuple(args.method), iterations=args.iters,
                           batchnorm=args.batchnorm, labels=args.labels, seed=args.seed,
                           threads=args.threads,
                           attack={"restarts": args.restarts, "start": args.start})
    options.check()
    transform, shape = parse_transform(args.input_transform), parse_shape(args.shape)
    truth = load_truth(args.truth)
    reference, reference_labels = load_reference(args.reference)
    separating = "separate" in options.methods
    if separating and reference is None:
        raise ConfigError("--method separate starts from auxiliary images of the task (never "
                          "the client's): give them with --reference")
    if args.start == "class-mean" and reference_labels is None:
        raise ConfigError("--start class-mean begins from each label's mean auxiliary image: "
                          "give labelled images with --reference (digits, photos, or a "
                          "safetensors file with 'images' and 'labels')")
    if reference is not None and truth is None and not separating and args.start == "random":
        raise ConfigError("--reference scores the mean image beside the attack, which needs "
                          "--truth too")
    if reference is not None and truth is not None and \
            tuple(reference.shape[1:]) != tuple(truth.images.shape[1:]):
        raise ConfigError(f"--reference images are {tuple(reference.shape[1:])}, the truth's "
                          f"{tuple(truth.images.shape[1:])}")
    if options.labels == "known" and (truth is None or truth.labels is None):
        raise ConfigError("--labels known needs --truth FILE with a 'labels' tensor")
    declared = {k: v for k, v in (("lr", args.lr), ("epochs", args.epochs),
                                  ("batch", args.batch), ("steps", args.steps)) if v is not None}
    updates = [Path(u) for u in args.update]
    labels = update_labels(updates)
    metas = [read_meta(u) for u in updates]  # every file's header, before any work
    for path, meta in zip(updates, metas):
        if shape is not None:
            check_meta({**meta, "shape": list(shape)}, f"{path} with --shape", ConfigError)
        reads_reference = separating or args.start == "class-mean"
        if reads_reference and tuple(reference.shape[1:]) != tuple(shape or meta["shape"]):
            raise ConfigError(f"--reference images are {tuple(reference.shape[1:])}, {path}'s "
                              f"client trained on {tuple(shape or meta['shape'])}")
        if transform is None:
            transform_from_dict(meta.get("input_transform"), str(path))
        Training.from_mapping({**meta.get("config", {}), **meta.get("hyperparameters", {}),
                               **declared}, f"{path}: hyperparameters")
    if args.model is None and len({str(meta.get("model")) for meta in metas}) > 1:
        raise ConfigError(f"the update files name different models "
                          f"({', '.join(sorted({str(m.get('model')) for m in metas}))}): "
                          "invert each model's updates apart, or pass --model")
    model_ref = args.model or metas[0].get("model")
    if not model_ref:
        raise ConfigError(f"{updates[0]}: the update file names no model: pass --model NAME, "
                          "a model factory registered by a plugin")
    field = "--model" if args.model else f"{updates[0]}: metadata 'model'"
    factory = find(MODEL_FACTORIES, model_ref, field)  # checked, never called, before any work
    factory.arguments({}, field)
    model_fn = factory.function
    for path in updates:  # each file read whole: the model fits its arrays (no folder yet)
        update = read_update(path)
        model = model_fn()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"{field}: model factory {factory.name!r} returned a "
                              f"{type(model).__name__}, expected a torch.nn.Module")
        for name, state in (("w0", update.w0), ("wT", update.wT)):
            split_state(model, state, f"{path}: {name}")
        training = Training.from_mapping({**update.meta.get("config", {}),
                                          **update.meta.get("hyperparameters", {}),
                                          **declared}, f"{path}: hyperparameters")
        mode = options.batchnorm or update.meta.get("batchnorm", "train")
        if "sim" in options.methods:
            try:
                replay_config(model, update.w0, update.wT, int(update.meta["num_examples"]),
                              training, mode)
            except ConfigError as error:
                raise ConfigError(f"{path}: {error} (here: --lr, --epochs, --batch)") from None
        examples = int(update.meta["num_examples"])
        if TRAINING_FREE in options.methods:
            stored = update.meta
            given = transform or transform_from_dict(stored.get("input_transform"), str(path))
            try:
                plan_walk(model, tuple(shape or stored["shape"]), given or identity, examples,
                          training.local_steps(examples), training.optimiser, mode)
            except ConfigError as error:
                raise ConfigError(f"{path}: {error}") from None
        if options.labels == "infer":
            steps = counted_steps(model, update.w0, update.wT) if mode == "train" else None
            gap = inference_gap(training, steps or training.local_steps(examples), examples)
            if gap is not None:
                raise ConfigError(f"{path}: labels were not given, and {gap}: declare --lr and "
                                  "--epochs with --batch (or --steps), or --labels known with "
                                  "--truth")
    out = check_output(args.out, "--out", directory=True)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for path, label in zip(updates, labels):
        rows += [{**r, "update": label} for r in audit_update(
            path, model_fn, options, out, truth=truth, reference=reference,
            input_transform=transform, declared=declared, shape=shape, label=label,
            reference_labels=reference_labels)]
    audit = {"format": "gradleak-fedavg-invert", "model": model_ref,
             "options": options.to_dict(), "summary": summarise(rows), "rows": rows}
    write_json(out / "audit.json", audit)
    write_fedavg_report(out, audit)
    lines = [f"{r['update']} {r['method']}: "
             + (f"{r['separation']['hyperplanes']} of {r['num_examples']} hyperplanes"
                + ("" if r["separation"]["complete"] else ", images from sme")
                if r.get("separation") else f"1 − cos {r['l_sim']:.4f}")
             + (f", PSNR {r['psnr']:.2f} dB, SSIM {r['ssim']:.3f}, {r['exact']} of "
                f"{r['images']} exact" if "psnr" in r else "")
             + (f" (mean image {r['mean_image']['psnr']:.2f} dB)" if "mean_image" in r else "")
             + "".join(f"\n  warning: {w}" for w in r["warnings"]) for r in rows]
    emit(args, audit["summary"], "\n".join(lines) + f"\n-> {out / 'report.html'}")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from gradleak.fedavg.attacks import METHODS, STARTS

    p = sub.add_parser("fedavg-invert", help="invert recorded FedAvg client updates (files "
                       "written by gradleak.integrations.flower)")
    common_flags(p)
    p.add_argument("--update", nargs="+", required=True, metavar="FILE",
                   help="update files (.safetensors) written by the Flower AuditStrategy or "
                   "gradleak.fedavg.write_update")
    p.add_argument("--model", help="a model factory registered with "
                   "@gradleak.register_model_factory(NAME), building the model with no "
                   "arguments (its module loaded with --plugin); default: the file's")
    p.add_argument("--method", nargs="+", default=["sme"], choices=METHODS)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--restarts", type=int, default=1, help="independent starts per method; the "
                   "one whose update matches best (1 − cos) is kept")
    p.add_argument("--start", choices=list(STARTS), default="random",
                   help="where the dummy images start: random, or class-mean (each inferred "
                   "label's mean --reference image, a label-conditioned prior)")
    p.add_argument("--batchnorm", choices=["train", "eval"],
                   help="the mode the client trained BatchNorm in (default: the file's)")
    p.add_argument("--input-transform", help="none, or normalize:MEAN,STD: how [0, 1] images "
                   "became the model's input (default: the file's)")
    p.add_argument("--shape", help="C,H,W of one image (default: the file's)")
    p.add_argument("--labels", choices=["infer", "known"], default="infer")
    p.add_argument("--truth", help="safetensors with 'images' (N, C, H, W) in [0, 1] and "
                   "optionally 'labels': scores the recovery (used for nothing else)")
    p.add_argument("--reference", help="auxiliary images of the task, none the client's: with "
                   "--truth their mean is the reference row (with labels, each used label's mean "
                   "is scored too); method separate starts from them. digits, photos, "
                   "femnist:PATH, cifar100:PATH or a safetensors file with 'images'")
    for name in ("epochs", "batch", "steps"):
        p.add_argument(f"--{name}", type=int, help=f"the client's {name} (overrides the file)")
    p.add_argument("--lr", type=float, help="the client's learning rate (overrides the file)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=run)
