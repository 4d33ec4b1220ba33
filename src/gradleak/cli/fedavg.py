"""`gradleak fedavg`: simulate a FedAvg client and invert its multi-step update."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradleak.cli.common import common_flags, emit, progress


def run(args: argparse.Namespace) -> None:
    from gradleak.fedavg.attacks import FedAttackConfig
    from gradleak.fedavg.client import ClientConfig
    from gradleak.fedavg.experiment import run_fedavg

    client = ClientConfig(epochs=args.epochs, samples=args.samples, batch=args.batch,
                          lr=args.client_lr, optimiser=args.optimiser,
                          batchnorm_train=args.batchnorm_train, seed=args.seed)
    attack = FedAttackConfig(method=args.attack, iterations=args.iters, cls=args.cls,
                             labels=args.labels, span=not args.no_span,
                             feature_span=0.0 if args.no_span else FedAttackConfig.feature_span,
                             restarts=args.restarts, start=args.start, seed=args.seed)
    result = run_fedavg(args.dataset, args.model, client, attack, Path(args.out),
                        progress=progress(args))
    separation = result["separation"]
    matched = (f"separated: {separation['hyperplanes']} of {args.samples} hyperplanes"
               + ("" if separation["complete"] else ", images from sme")
               if separation else f"L_sim raw {result['l_sim_raw']:.4f}")
    text = (f"{args.attack} on {result['dataset']} (E={args.epochs}, N={args.samples}, "
            f"B={args.batch}): PSNR {result['psnr']:.2f} ± {result['psnr_std']:.2f} dB, SSIM "
            f"{result['ssim']:.3f}, {matched}"
            + (f" (scaled {result['l_sim_scaled']:.4f})" if result["l_sim_scaled"] is not None
               else "") + f", {result['seconds']:.1f} s -> {args.out}")
    emit(args, result, text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from gradleak.fedavg.attacks import METHODS, STARTS

    p = sub.add_parser("fedavg", help="simulate a FedAvg client and invert its update")
    common_flags(p)
    p.add_argument("--dataset", default="digits",
                   help="digits, photos (embedded stand-ins), femnist:PATH or cifar100:PATH")
    p.add_argument("--model", default="cnn",
                   help="cnn (LEAF/SME), cnn-bn, resnet8, lenet-sigmoid, flower-cnn (Flower's "
                   "template) or "
                   "mlp (first layer Linear on the image: its update holds the images' span, "
                   "which the attack keeps to)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--client-lr", type=float, default=0.004)
    p.add_argument("--optimiser", default="sgd", help="the client's: sgd, momentum, adamw")
    p.add_argument("--batchnorm-train", action="store_true",
                   help="the client trains with BatchNorm in train mode (models cnn-bn, resnet8), "
                   "and the attack replays it so")
    p.add_argument("--attack", default="nlsme", help=f"{', '.join(METHODS)} (sim replays the "
                   "client's declared steps, after Dimitrov et al.; separate tells model mlp's "
                   "images apart exactly, from the dataset's other images)")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--restarts", type=int, default=1, help="independent starts; the one whose "
                   "update matches best (1 − cos) is kept")
    p.add_argument("--start", choices=list(STARTS), default="random",
                   help="where the dummy images start: random, or class-mean (each inferred "
                   "label's mean image among the dataset's other images)")
    p.add_argument("--cls", type=float, default=0.0, help="λ_cls (uses the labels)")
    p.add_argument("--labels", default="infer", choices=["infer", "known"],
                   help="infer the client's labels from its output-layer bias update "
                   "(default), or assume them known (stated in the results)")
    p.add_argument("--no-span", action="store_true",
                   help="the control: use no span a Linear layer's update determines (the "
                   "images' span of a first Linear layer; each Linear layer's input span of a "
                   "one-step update)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=run)
