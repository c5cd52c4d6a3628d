"""Evaluation in four wings, each a floor (docs/architecture.md), imports pointing down:

  readouts (this folder: `readouts`, `readout_plots`): the three cheap readouts of one model
  probe/     the k -> |V| probe and the readout controls, fitted to a held-out plateau
  zeroshot/  scores without training: PLL, BLiMP, held-out tokens, unigram control, rank,
             frozen-encoder linear probes
  finetune/  the fine-tuning suite: tasks, cells (classification, QA, retrieval), the grid
  compare/   statistics over paired rows, the report

Import the submodules directly (``from mlsm.evaluate.finetune.finetune import finetune``); the
package files stay empty so that importing one evaluator does not pull in the others'
dependencies.
"""
