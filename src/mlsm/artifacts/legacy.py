"""What mlsm still reads of the artifacts its first release wrote, and until which version.

mlsm 0.1.0 wrote token stores, dictionaries, target stores, run folders and checkpoints that
record less than today's (no content fingerprints, no teacher weights, no checkpoint facts).
Each such older form that a reader still accepts is named once in `FORMS`, with the module whose
reader recognises it and what happens to it there. The recognising code stays beside its
artifact's reader, in that reader's layer (a token store's check cannot import a study, and this
layer must not import either), but every branch that accepts an older form asks
`tolerated(FORM)` first.

`SUNSET` is the first version that reads none of them: tests/test_legacy.py fails from that
version on until the forms and their branches are deleted. A form taken out of `FORMS` turns its
branch off (`tolerated` answers False: the branch falls through to what it does for a folder of
unknown provenance, refuse or rebuild), and the same test then asks for the branch to go. So the
compatibility code is listed in one place, cannot grow unnoticed (every call names a form here,
every form has its call), and has an end.
"""

from __future__ import annotations

import re

SUNSET = "0.3.0"
"""The first release that no longer reads the forms below (0.2.x is the last that does, so
`mlsm migrate` and a rebuild have one minor release to run on old folders)."""

FORMS: dict[str, tuple[str, str]] = {
    "store-path-fingerprint": (
        "mlsm.data.corpus",
        "a token store fingerprinted by (path, size, mtime): adopted when those still match, and "
        "its content fingerprint recorded"),
    "study-shared-unrecorded": (
        "mlsm.study.preparation",
        "a study's dictionary or target store made before the study recorded fingerprints: "
        "adopted (or resumed) when its own meta names the same settings and inputs"),
    "dictionary-teacher-unrecorded": (
        "mlsm.teacher.dictionary",
        "a dictionary that names its teacher but no fingerprint of the teacher's weights: used, "
        "with one warning"),
    "targets-teacher-unrecorded": (
        "mlsm.teacher.targets",
        "a target store begun before builds recorded their teacher's weights: continued, and "
        "the weights recorded"),
    "run-inputs-unrecorded": (
        "mlsm.artifacts.rundir",
        "a run folder whose run.json records no input fingerprints: resumed, and checked from "
        "then on"),
    "checkpoint-facts-unrecorded": (
        "mlsm.migrate",
        "a checkpoint or export without latent_head and pll_refusal: `mlsm migrate` writes them "
        "(every reader refuses such a folder, naming that command)"),
}


def _release(version: str) -> tuple[int, ...]:
    """'0.2.1' -> (0, 2, 1); a suffix such as '.dev0' or 'rc1' ends the number."""
    parts = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(parts)


def past_sunset(version: str) -> bool:
    """Whether `version` is at or after `SUNSET`."""
    return _release(version) >= _release(SUNSET)


def tolerated(form: str) -> bool:
    """Whether this version still reads the older form `form`: whether `FORMS` lists it."""
    return form in FORMS
