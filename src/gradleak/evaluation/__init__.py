"""Wiring of attacks to captures and metrics: the one place that holds both an observation and
its target. Attacks never see the target; scores never feed back into an attack."""

from gradleak.evaluation.actions import evaluate_action_rules

__all__ = ["evaluate_action_rules"]
