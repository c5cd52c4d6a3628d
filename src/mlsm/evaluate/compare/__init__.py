"""Comparing results: bootstrap and Wilcoxon statistics over paired rows, the paired
tables, the report (figures and Markdown). The lowest wing of `mlsm.evaluate`."""
