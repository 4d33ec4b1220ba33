"""Closed-form action rules scored over whole capture files (read in row chunks)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from gradleak.attacks.action_rules import RULES, policy_weight, recover_actions
from gradleak.capture.shards import open_captures
from gradleak.errors import ConfigError
from gradleak.evaluation.oracles import ORACLE_RULES, oracle_actions
from gradleak.metrics.actions import action_accuracy

CHUNK_ROWS = 4096


def evaluate_action_rules(paths: Sequence[str | os.PathLike[str]], rules: Sequence[str],
                          skip_nonfinite: bool = False) -> dict[str, dict[str, Any]]:
    """Accuracy of each closed-form rule over one or more capture files."""
    if not rules:
        raise ConfigError("--rule: expected at least one rule, e.g. odd-sign")
    for rule in rules:  # unknown names fail before any file is read
        if rule not in ORACLE_RULES:
            RULES.get(rule)
    files = open_captures(paths)
    skipped = 0
    predicted: dict[str, list[np.ndarray]] = {rule: [] for rule in rules}
    actual, probs, advantages = [], [], []
    try:
        for capture in files:
            usable = capture.usable_rows(skip_nonfinite)
            skipped += int((~usable).sum())
            for start in range(0, capture.num_rows, CHUNK_ROWS):
                rows = slice(start, min(start + CHUNK_ROWS, capture.num_rows))
                if not usable[rows].all():
                    rows = np.flatnonzero(usable[rows]) + start
                    if not len(rows):
                        continue
                observation = capture.observation(rows, layers=[policy_weight(capture.roles)],
                                                  with_theta0=False)
                target = capture.target(rows, images=False)
                for rule in rules:  # an oracle rule is given the truth, and reports say so
                    found = oracle_actions(observation, rule, target) if rule in ORACLE_RULES \
                        else recover_actions(observation, rule)
                    predicted[rule].append(found.actions)
                actual.append(target.actions)
                probs.append(target.probs)
                advantages.append(target.advantages)
    finally:
        for capture in files:
            capture.close()
    truth, pi, adv = np.concatenate(actual), np.concatenate(probs), np.concatenate(advantages)
    results = {}
    for rule in rules:
        scores = action_accuracy(np.concatenate(predicted[rule]), truth, pi, adv)
        scores["rule"] = rule
        scores["oracle_advantage_sign"] = rule in ORACLE_RULES
        scores["skipped_nonfinite_rows"] = skipped
        results[rule] = scores
    return results
