"""Multi-step FedAvg: any classifier's update inverted (IG, SME, NL-SME and their controls),
client simulation, victim classifiers, and scores matched to the truth.

    from gradleak.fedavg import invert_update, Normalize, score_recovery
"""

from gradleak.fedavg.forward import ClientForward
from gradleak.fedavg.invert import (FitWarning, InversionResult, Normalize, Training,
                                    invert_update, split_state)
from gradleak.fedavg.scoring import hungarian_match, label_agreement, score_recovery

__all__ = ["ClientForward", "FitWarning", "InversionResult", "Normalize", "Training",
           "hungarian_match", "invert_update", "label_agreement", "score_recovery",
           "split_state"]
