"""The paper's evaluation as named, resumable experiments (`gradleak experiment NAME`).

A user's own experiment is one decorator in their module, loaded with --plugin:

    from gradleak.experiments import Experiment, register_experiment

    @register_experiment("mine")
    class Mine(Experiment):
        def axes(self, seeds): return {"setting": ["a", "b"], "seed": list(range(seeds))}
        def run_cell(self, cell, context): return {"psnr": ...}
        def summarize(self, results): return {...}, "| markdown |"
"""

from gradleak.experiments.base import (EXPERIMENTS, Cell, Context, Experiment,
                                       register_experiment)
from gradleak.experiments.runner import (ExperimentSettings, grouped, mean_std,
                                         merge_experiment, run_experiment)

from gradleak.experiments import (  # noqa: E402,F401  (the built-ins register themselves)
    auxscale,
    components,
    context,
    defense_figure,
    fewshot,
    losses,
    table1,
)

__all__ = ["EXPERIMENTS", "Cell", "Context", "Experiment", "ExperimentSettings", "grouped",
           "mean_std", "merge_experiment", "register_experiment", "run_experiment"]
