"""Evaluation: fine-tuning suite (tasks, finetune, stats, report) and, beside it, PLL/BLiMP/probes.

Import the submodules directly (``from mlsm.evaluate.finetune import finetune``); this package
file stays empty so that importing one evaluator does not pull in the others' dependencies.
"""
