"""A refactor must not change the fingerprint of any stage of a shipped study: a running study
resumes by them, and a changed one would redo (or refuse) stages that are done.

The fingerprints of every stage of each study file below (its paths, each arm's resolved run
config, and the inputs of the store, dictionary, targets, pre-training, probe, fine-tuning, BLiMP
and readout stages) are computed twice, each in a fresh interpreter: with this tree's code and
with the code of REFERENCE, a commit from before the study's arm settings were typed. They must be
equal. The reference tree is `git archive REFERENCE src` of this repository (skipped where the
history is not there, e.g. a shallow clone); MLSM_REFERENCE_SRC names another src folder instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "4a45efd"
"""main before issue #51's refactor (the study cpu_replication_v3 was started from it)."""
STUDIES = ["studies/cpu_replication_v3.yaml", "studies/cpu_replication.yaml"]

_SCRIPT = r"""
import json, sys
from mlsm.study.folder import Study, fingerprint_of
from mlsm.study import reuse
from mlsm.study.spec import load_study
from mlsm.config import config_to_dict

spec = load_study(sys.argv[1], out=sys.argv[2])
study = Study(spec, lambda m: None)
out = {"store": fingerprint_of(reuse.store_inputs(study))}
for arm in spec.arms:
    row = {"dictionary_path": str(study.dictionary_path(arm)),
           "targets_path": str(study.targets_path(arm)),
           "config": config_to_dict(study.arm_config(arm)),
           "pretrain": fingerprint_of(reuse.pretrain_inputs(study, arm)),
           "finetune": fingerprint_of(reuse.finetune_inputs(study, arm))}
    if study.dictionary_path(arm) is not None:
        row["dictionary"] = fingerprint_of(reuse.dictionary_inputs(study, arm))
        row["dictionary_settings"] = reuse.dictionary_settings(study, arm)
    if study.targets_path(arm) is not None:
        row["targets"] = fingerprint_of(reuse.targets_inputs(study, arm))
    heads = (["latent"] if study.is_latent(arm) else []) + list(spec.probe.controls)
    for frac in sorted(set(spec.readiness) | set(spec.blimp.readiness)):
        for head in heads:
            row[f"probe:{head}@{frac}"] = fingerprint_of(reuse.probe_inputs(study, arm, frac, head))
        row[f"blimp@{frac}"] = fingerprint_of(reuse.blimp_inputs(study, arm, frac))
        row[f"readout@{frac}"] = fingerprint_of(reuse.readout_inputs(study, arm, frac))
    out[arm] = row
print(json.dumps(out, sort_keys=True))
"""


def _reference_src(tmp: Path) -> Path:
    given = os.environ.get("MLSM_REFERENCE_SRC")
    if given:
        return Path(given)
    archive = tmp / "reference.tar"
    made = subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), REFERENCE,
                           "src"], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"commit {REFERENCE} is not in this clone's history ({made.stderr.strip()})")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "reference", filter="data")
    return tmp / "reference" / "src"


NEW_VOLATILE_TRAIN_KEYS = ("eval_every", "eval_batches")


def _fingerprints(src: Path, study: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT / study), str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_stage_fingerprint_of_the_shipped_studies_is_unchanged(tmp_path: Path) -> None:
    reference = _reference_src(tmp_path)
    for study in STUDIES:
        out = tmp_path / Path(study).stem  # the same (empty) study folder for both
        now, before = (_fingerprints(src, study, out) for src in (ROOT / "src", reference))
        assert set(now) == set(before) and len(now) > 2, study
        for arm in before:
            # settings added since the reference that no fingerprint reads (volatile in studies:
            # train.eval_every / eval_batches, validation during pre-training) are not compared
            if isinstance(now[arm], dict) and "config" in now[arm]:
                for key in NEW_VOLATILE_TRAIN_KEYS:
                    now[arm]["config"]["train"].pop(key, None)
            assert now[arm] == before[arm], f"{study}: {arm}"
