"""DP-SGD's noise multiplier from Opacus's RDP accountant (the accountant, not a re-derivation)."""

from __future__ import annotations

import functools
import warnings

from gradleak.errors import ConfigError


@functools.lru_cache(maxsize=64)
def dp_noise_multiplier(eps: float, delta: float, sample_rate: float, steps: int
                        ) -> tuple[float, float]:
    """σ such that `steps` noisy steps at sampling rate q spend at most (ε, δ); and the ε that
    σ actually achieves (Opacus searches σ to within its ε tolerance of 0.01)."""
    try:
        from opacus.accountants import RDPAccountant
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:
        raise ConfigError("the dpsgd defense needs Opacus's accountant: pip install -c "
                          "constraints.txt opacus") from None
    with warnings.catch_warnings():
        # Opacus warns when the best Rényi order is its largest; the bound is still valid
        warnings.simplefilter("ignore", UserWarning)
        sigma = float(get_noise_multiplier(target_epsilon=eps, target_delta=delta,
                                           sample_rate=sample_rate, steps=steps,
                                           accountant="rdp"))
        accountant = RDPAccountant()
        accountant.history = [(sigma, sample_rate, steps)]
        achieved = float(accountant.get_epsilon(delta))
    return sigma, achieved
