"""Every printed fix is run by a test (issue #52 item 7).

A refusal line that ends with a command (`...: mlsm probe RUN`, `... --resume auto`, `mlsm
migrate RUN`, `mlsm prepare ... --out STORE`) promises that the command, as printed, gets the
user past the refusal. For each case of the bad-input table in `HINTS_RUN` (tests/fix_hints.py;
the table checks that every case printing a command is there or shares its sentence with one
that is), this runs the case, takes the command from its line (shlex-split), fills in only the
UPPER-CASE words that stand for the user's own values and tiny sizes the fixtures need, runs it
through `mlsm.cli.main`, and asserts exit 0; where the command repairs the input (rather than
naming another verb to use instead), the refused command is run again and must not meet the same
refusal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlsm.cli import main

from .fix_hints import HINTS_RUN, fix_hints
from .test_bad_inputs_classes import CASES, _glue, unscored_ckpts  # noqa: F401
from .test_bad_inputs_data import CASES as DATA_CASES
from .test_bad_inputs_data import (  # noqa: F401  (fixtures, shared with the data table)
    _one_line_error,
    fx,
)

# the hints that name another verb to use instead, rather than repair what was refused
INSTEAD = {"finetune", "study"}
# the refused command's flag that the line says to point at what the fix wrote (its --out)
PASS_THE_NEW = {"consistency_probe_store_of_another_tokenizer": "--store",
                "consistency_targets_dictionary_naming_no_teacher": "--dictionary"}


def _tiny(verb: str, fix: dict, tmp: Path) -> list[str]:
    """What a fixture-sized run of `verb` needs beyond the printed command (sizes only)."""
    return {
        "probe": ["--max-steps", "4", "--eval-every", "2", "--batch-size", "4"],
        "dictionary": ["--teacher", str(fix["teacher_dir"]), "--layer", "1", "--k", "16",
                       "--n-vectors", "50", "--max-len", "32"],
        "finetune": ["--data-dir", str(_glue(tmp / "hint")), "--results",
                     str(tmp / "hint-results.jsonl"), "--seeds", "1", "--epochs", "1",
                     "--max-len", "16"],
    }.get(verb, [])


def _filled(command: list[str], fix: dict, tmp: Path) -> list[str]:
    """The user's own values for the printed placeholders; any other word stays as printed."""
    values = {"SOURCES": str(fix["corpus_dir"]), "TOK": str(fix["tokenizer_dir"]),
              "TASKS": "rte", "STUDY.yaml": str(tmp / "s.yaml"),
              "NEW_STORE": str(tmp / "new-store"),
              "NEW_DICT": str(tmp / "new-dict.safetensors")}
    out = []
    for before, word in zip(["", *command[:-1]], command, strict=True):
        if word == "STORE":  # a store to read, or one to write
            word = str(fix["store_dir"]) if before == "--store" else str(tmp / "new-store")
        word = values.get(word, word)
        assert not word.replace("_", "").isupper(), f"unknown placeholder {word} in {command}"
        out.append(word)
    given = set(out)
    extra = _tiny(command[0], fix, tmp)
    for i in range(0, len(extra), 2):  # a size the command already gives is kept as printed
        if extra[i] not in given:
            out += extra[i:i + 2]
    return out


@pytest.mark.parametrize("name", list(HINTS_RUN))
def test_the_printed_fix_works_as_printed(name: str, fx: dict,  # noqa: F811
                                          tmp_path: Path, capsys) -> None:
    args = (CASES.get(name) or DATA_CASES[name])(tmp_path, fx)[0]
    capsys.readouterr()
    line = _one_line_error(main(args), capsys.readouterr().err)
    hints = [h for h in fix_hints(line) if h[0] == HINTS_RUN[name]]
    assert len(hints) == 1, line
    command = _filled(hints[0], fx, tmp_path)
    if "delete it and" in line:  # as the line says: the damaged output goes first
        out = Path(command[command.index("--out") + 1])
        for path in (out, out.with_suffix(".json")):
            path.unlink(missing_ok=True)
    rc = main(command)
    err = capsys.readouterr().err
    assert rc == 0, f"the fix printed by {name} fails: mlsm {' '.join(command)}\n{err}"
    if hints[0][0] in INSTEAD:
        return
    if name in PASS_THE_NEW:
        flag = PASS_THE_NEW[name]
        args[args.index(flag) + 1] = command[command.index("--out") + 1]
    rc = main(args)
    assert rc == 0 or line not in capsys.readouterr().err, f"{name}: the same refusal again"
