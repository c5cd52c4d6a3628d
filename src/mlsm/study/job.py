"""One evaluation stage of one arm in a process of its own: what a local study with
`executor.eval_jobs` above 1 starts for each arm and readiness point
(`executors.evaluation_subprocess`), as a Slurm job runs `run_arm_stage`.

    python -m mlsm.study.job OUT/configs/study-job.json STAGE ARM [POINT [HEAD]]

POINT (a readiness point as the study names it, e.g. 25%) restricts the stage to that
checkpoint; without it, every point. Fine-tuning takes no POINT: its grid is one stage. HEAD
restricts the probe stage to one probe: `latent` (a latent arm's own) or a readout control of
`probe.controls`; a local study fits each head in a subprocess of its own, side by side.

The JSON file is the driver's study exactly (`spec.spec_record`, with `jobs: 1`), so this process
computes the same paths and fingerprints as the driver. Re-reading the study file would not: a
seeded study's runs (ARM-s<seed>) would be seeded again, and relative paths resolved against
the folder of the copy. Bad arguments or a file that is not such a record are one line on stderr
and exit status 2, as for every `mlsm` command.
"""

from __future__ import annotations

import dataclasses
import sys

from mlsm.errors import UserError
from mlsm.inputs import read_json
from mlsm.study.spec import StudySpec, readiness_label, spec_from_record
from mlsm.study.stages import EVALUATIONS, run_arm_stage

PROG = "mlsm study job"
_FIX = "it is written by `mlsm study` for its own subprocesses; run `mlsm study STUDY.yaml` instead"


def main(argv: list[str] | None = None) -> int:
    """Run the stage; 1 if any of its runs failed (each failure is in status.json), 2 on bad
    arguments, else 0."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) not in (3, 4, 5):
            raise UserError("usage: python -m mlsm.study.job OUT/configs/study-job.json STAGE ARM "
                            f"[POINT [HEAD]] (got {len(args)} arguments); {_FIX}")
        path, stage, arm = args[:3]
        if stage not in EVALUATIONS:
            raise UserError(f"unknown stage {stage!r}; one of {', '.join(EVALUATIONS)}")
        raw = read_json(path, "study job file", _FIX)
        missing = [f.name for f in dataclasses.fields(StudySpec) if f.name not in raw]
        if missing:
            raise UserError(f"study job file {path} is not a study record (no {missing[0]}); "
                            f"{_FIX}")
        spec = spec_from_record(raw)
        point = _point(spec, stage, args[3]) if len(args) >= 4 else None
        head = _head(spec, stage, args[4]) if len(args) == 5 else None
        return 1 if run_arm_stage(spec, stage, arm, point, head) else 0
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


def _point(spec: StudySpec, stage: str, label: str) -> float:
    """The readiness point named `label` (as `readiness_label` writes it)."""
    if stage == "finetune":
        raise UserError(f"fine-tuning runs every readiness point in one grid; drop {label!r}")
    points = {readiness_label(f): f for f in spec.readiness}
    if label not in points:
        raise UserError(f"readiness point {label!r} is not one of the study's "
                        f"({', '.join(points)}); {_FIX}")
    return points[label]


def _head(spec: StudySpec, stage: str, head: str) -> str:
    """The probe head named `head`: latent or one of the study's readout controls."""
    heads = ["latent", *spec.probe.controls]
    if stage != "probe" or head not in heads:
        raise UserError(f"HEAD {head!r} names one probe of the probe stage: one of "
                        f"{', '.join(heads)} (stage {stage!r}); {_FIX}")
    return head


if __name__ == "__main__":
    sys.exit(main())
