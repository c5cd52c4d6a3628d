"""`mlsm study STUDY.yaml`: several pre-training arms on identical batches.

The arms are evaluated and compared.
"""

from mlsm.study.runner import run_study
from mlsm.study.spec import StudySpec, load_study

__all__ = ["StudySpec", "load_study", "run_study"]
