"""Metrics: action accuracy (here), image metrics (MSE, PSNR, SSIM, LPIPS) later."""
