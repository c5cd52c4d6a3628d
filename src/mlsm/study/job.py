"""One evaluation stage of one arm in a process of its own: what a local study with
`executor.jobs` > 1 starts for each arm (`executors._local_jobs`), as a Slurm job runs
`run_arm_stage`.

    python -m mlsm.study.job OUT/configs/study-job.json STAGE ARM

The JSON file is the driver's study exactly (`spec.spec_record`, with `jobs: 1`), so this process
computes the same paths and fingerprints as the driver. Re-reading the study file would not: a
seeded study's runs (ARM-s<seed>) would be seeded again, and relative paths resolved against
the folder of the copy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlsm.study.spec import spec_from_record
from mlsm.study.stages import run_arm_stage


def main(argv: list[str] | None = None) -> int:
    """Run the stage; 1 if any of its runs failed (each failure is in status.json), else 0."""
    path, stage, arm = sys.argv[1:] if argv is None else argv
    spec = spec_from_record(json.loads(Path(path).read_text(encoding="utf-8")))
    return 1 if run_arm_stage(spec, stage, arm) else 0


if __name__ == "__main__":
    sys.exit(main())
