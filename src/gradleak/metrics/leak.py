"""When a reconstruction beats a reference that uses no gradient: the rule every verdict reads
(the RL audit's, the FedAvg audit's).

- PSNR: a gain over the reference of more than STOP_MARGIN_DB;
- SSIM: more than SSIM_MARGIN above the reference's;
- LPIPS: more than LPIPS_MARGIN below the reference's (lower is closer).

The margins are the size of the gap between the two references that use no gradient (the mean
image and each frame's own mean colour differ by 0.01–0.02 on SSIM and LPIPS in the demo and the
paper audit), so a difference within them is not evidence of a leak and one beyond them is.
"""

from __future__ import annotations

from typing import Any

STOP_MARGIN_DB = 1.0
SSIM_MARGIN = 0.02
LPIPS_MARGIN = 0.02


def leaks(row: dict[str, Any], reference: dict[str, Any],
          control: dict[str, Any] | None = None) -> list[str]:
    """The image metrics on which a frame attack beats the reference (empty: at it on all
    three), and "<metric> not measured" for each it could not be cleared on. A learned
    attacker's `control` (itself fed other steps' gradients) is a reference too: what its
    training alone reconstructs is no leak of these gradients (a sharp typical frame beats the
    mean image's blur on LPIPS with no information at all), so each metric is set against the
    better of the two."""
    found = []
    gain = row.get("psnr_gain_over_mean_image")
    if gain is not None and control and control.get("psnr") is not None:
        gain = min(gain, row["psnr"] - control["psnr"])
    if gain is None:
        found.append("psnr not measured")
    elif gain > STOP_MARGIN_DB:
        found.append(f"PSNR {gain:+.2f} dB")
    for metric, margin, better in (("ssim", SSIM_MARGIN, 1.0), ("lpips", LPIPS_MARGIN, -1.0)):
        mine = row.get(metric)
        theirs = [r[metric] for r in (reference, control) if r and r.get(metric) is not None]
        best = None if not theirs else (max(theirs) if better > 0 else min(theirs))
        if mine is None or best is None:
            found.append(f"{metric} not measured")
        elif better * (mine - best) > margin:
            found.append(f"{metric.upper()} {mine:.3f} against {best:.3f}")
    return found
