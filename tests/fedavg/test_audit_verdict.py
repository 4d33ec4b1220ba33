"""The FedAvg audit's verdict reads SSIM and LPIPS beside PSNR, by the RL verdict's rule
(`metrics.leak`), and shows each image's own mean colour beside the mean image."""

from __future__ import annotations

import torch

from gradleak.fedavg.audit import Truth, score_row, summarise
from gradleak.report.fedavg import verdict_lines


def row(psnr: float, ssim: float, lpips: float) -> dict:
    reference = {"psnr": 12.8, "ssim": 0.45, "lpips": 0.11}
    return {"method": "sme", "update": "node-1.safetensors", "l_sim": 0.1, "seconds": 1.0,
            "warnings": [], "num_examples": 4, "labels_inferred": True, "psnr": psnr,
            "ssim": ssim, "lpips": lpips, "psnr_gain_over_mean_image": psnr - reference["psnr"],
            "mean_image": reference, "mean_colour": {"psnr": 9.9, "ssim": 0.3, "lpips": 0.5}}


def test_an_attack_at_the_mean_image_in_psnr_but_far_closer_in_lpips_leaks() -> None:
    summary = summarise([row(13.0, 0.46, 0.05)])
    assert summary["sme"]["leaks"] == ["LPIPS 0.050 against 0.110"]
    text = " ".join(verdict_lines({"rows": [row(13.0, 0.46, 0.05)], "summary": summary}))
    assert "beyond it on LPIPS 0.050 against 0.110" in text
    assert "own mean colour (an oracle) scores PSNR 9.90 dB" in text


def test_an_attack_at_the_mean_image_on_all_three_metrics_is_said_so() -> None:
    summary = summarise([row(13.2, 0.46, 0.10)])
    assert summary["sme"]["leaks"] == []
    text = " ".join(verdict_lines({"rows": [row(13.2, 0.46, 0.10)], "summary": summary}))
    assert "at it on PSNR, SSIM and LPIPS" in text


def test_each_scored_row_carries_the_per_image_mean_colour(tmp_path) -> None:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(3, 1, 8, 8, generator=generator)
    colour = images.mean((2, 3), keepdim=True).expand_as(images)
    scored = score_row(colour.clone(), torch.tensor([0, 1, 2]), Truth(images), None, None,
                       tmp_path / "p.png", "sme")
    # the attack returned exactly each image's mean colour: the oracle's scores are its own
    assert abs(scored["mean_colour"]["psnr"] - scored["psnr"]) < 1e-6


def test_a_labels_known_audit_is_named_an_oracle() -> None:
    rows = [row(13.0, 0.46, 0.05)]
    text = " ".join(verdict_lines({"rows": rows, "summary": summarise(rows),
                                   "options": {"labels": "known"}}))
    assert "Labels known: an oracle" in text
    assert "oracle. The" not in " ".join(verdict_lines({"rows": rows,
                                                         "summary": summarise(rows),
                                                         "options": {"labels": "infer"}}))


def test_the_audit_counts_the_images_that_came_back_exactly(tmp_path) -> None:
    """Per image, not on average: two of three images returned to float32 rounding, one
    replaced by the mean image, scores 2 exact, 2 closer than the mean image on every metric;
    the counts add up over updates and the verdict says them."""
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(3, 1, 8, 8, generator=generator)
    reference = torch.rand(20, 1, 8, 8, generator=generator)
    recovered = images.clone()
    recovered[1] = reference.mean(0)
    recovered[0] += 1e-5 * torch.randn(1, 8, 8, generator=generator)
    scored = score_row(recovered.clamp(0, 1), torch.tensor([0, 1, 2]), Truth(images), reference,
                       None, tmp_path / "p.png", "sme")
    assert (scored["images"], scored["exact"], scored["above_mean_image"]) == (3, 2, 2)
    rows = [{**row(20.0, 0.8, 0.05), **scored}, {**row(20.0, 0.8, 0.05), **scored}]
    summary = summarise(rows)
    assert (summary["sme"]["images"], summary["sme"]["exact"]) == (6, 4)
    text = " ".join(verdict_lines({"rows": rows, "summary": summary}))
    assert "4 of 6 images came back exactly (≥ 40 dB), 4 closer than the mean image" in text


def test_the_verdict_leads_with_the_strongest_method_per_client_update() -> None:
    rows = [{**row(12.0, 0.5, 0.2), "method": "sme", "update": "node-1"},
            {**row(15.0, 0.6, 0.1), "method": "nlsme", "update": "node-1"},
            {**row(14.0, 0.6, 0.1), "method": "sme", "update": "node-2"},
            {**row(13.0, 0.6, 0.1), "method": "nlsme", "update": "node-2"}]
    text = " ".join(verdict_lines({"rows": rows, "summary": summarise(rows)}))
    assert "Strongest method per client update: node-1: nlsme 15.00 dB; node-2: sme 14.00 dB" \
        in text
