"""The `mlsm ...` commands a refusal line prints as its fix (issue #52 item 7).

A hint is `mlsm VERB` (a real verb of the CLI) followed by at least one argument, where a line
gives it as a command (see `_HINT`); a bare verb ("written by mlsm finetune") names a tool, not a
command to run. UPPER-CASE words (STORE, TOK, SOURCES, TASKS, STUDY.yaml) are the user's own
values, filled in by tests/test_fix_hints.py. The bad-input tables
(tests/test_bad_inputs_classes.py, tests/test_bad_inputs_data.py) ask of every case whose line
holds a hint that tests/test_fix_hints.py runs it (`HINTS_RUN`) or names the case whose identical
sentence it runs (`HINTS_SAME_AS`): a new refusal with a fix command cannot go untried.
"""

from __future__ import annotations

import re
import shlex

from mlsm.cli import build_parser


def _verbs() -> set[str]:
    parser, handlers = build_parser()
    return set(handlers)


VERBS = _verbs()
# a command stands in backticks, or right after a colon, a parenthesis, "with" or "then" (not
# "see mlsm X --help", not "an mlsm probe run"); it ends at a backtick, a closing parenthesis,
# a semicolon or the end of the line
_HINT = re.compile(r"(?:`|[:(] ?|\b(?:with|then) )mlsm ([a-z][a-z-]*)((?: [^`;)]*)?)")


def fix_hints(line: str) -> list[list[str]]:
    """The commands (argv after `mlsm`) that the refusal `line` prints as fixes."""
    body = line.split(": error: ", 1)[-1]  # not the "mlsm VERB: error:" prefix
    found = []
    for match in _HINT.finditer(body):
        verb, rest = match[1], match[2].strip()
        if verb in VERBS and rest:
            found.append([verb, *shlex.split(rest)])
    return found


# case name (of the bad-input table) -> the verb of the hint tests/test_fix_hints.py runs for it
HINTS_RUN = {
    "consistency_blimp_mlsm_run_without_its_probe": "probe",
    "consistency_blimp_run_whose_probe_is_unfinished": "pretrain",
    "consistency_score_run_unfinished": "pretrain",
    "content_blimp_checkpoint_of_mlsm_0_1_0": "migrate",
    "consistency_pretrain_token_id_beyond_vocab": "prepare",
    "consistency_probe_store_of_another_tokenizer": "prepare",
    "paths_probe_store_missing": "prepare",
    "content_pretrain_dictionary_atoms_all_zero": "dictionary",
    "content_targets_dictionary_truncated": "dictionary",
    "consistency_blimp_mae_lm_export": "finetune",
    "values_study_print_with_report": "study",
    "consistency_targets_dictionary_naming_no_teacher": "dictionary",
    "store_torn_meta": "prepare",  # of the data table (tests/test_bad_inputs_data.py)
}
# a case whose line holds the same sentence as one run above (only its paths differ)
HINTS_SAME_AS = {
    "consistency_blimp_clm_checkpoint": "consistency_blimp_mae_lm_export",
    "consistency_blimp_mae_lm_checkpoint": "consistency_blimp_mae_lm_export",
    "consistency_blimp_mae_lm_export_with_a_hand_edited_step": "consistency_blimp_mae_lm_export",
    "consistency_blimp_mae_mlsm_checkpoint": "consistency_blimp_mae_lm_export",
    "consistency_blimp_probe_of_a_mae_mlsm_checkpoint": "consistency_blimp_mae_lm_export",
    "consistency_probe_mae_lm_checkpoint": "consistency_blimp_mae_lm_export",
    "consistency_probe_mae_mlsm_checkpoint": "consistency_blimp_mae_lm_export",
    "consistency_dictionary_token_id_beyond_vocab": "consistency_pretrain_token_id_beyond_vocab",
    "content_probe_store_meta_without_tokenizer_hash":
        "consistency_pretrain_token_id_beyond_vocab",
    "content_targets_dictionary_meta_is_a_list": "content_targets_dictionary_truncated",
    "content_targets_dictionary_meta_k_differs_from_atoms": "content_targets_dictionary_truncated",
    "content_targets_dictionary_meta_lam_not_a_number": "content_targets_dictionary_truncated",
    "reuse_pretrain_dictionary_pair_of_two_learnings": "content_targets_dictionary_truncated",
    "reuse_targets_dictionary_json_stripped_of_its_teacher":
        "content_targets_dictionary_truncated",
    "reuse_targets_dictionary_pair_of_two_learnings": "content_targets_dictionary_truncated",
    "consistency_pretrain_dictionary_naming_no_teacher":
        "consistency_targets_dictionary_naming_no_teacher",
    "paths_pretrain_config_store_with_a_terminal_escape": "paths_probe_store_missing",
    "prepare_torn_store_no_overwrite": "store_torn_meta",
    "store_missing_offsets": "store_torn_meta",
    "store_offsets_inconsistent": "store_torn_meta",
    "store_truncated_tokens": "store_torn_meta",
}


def check_hint_is_tried(name: str, line: str) -> None:
    """A table case whose line prints a fix command is one whose command a test runs."""
    if fix_hints(line):
        assert name in HINTS_RUN or name in HINTS_SAME_AS, (
            f"{name} prints a fix command ({line}); run it in tests/test_fix_hints.py "
            "(HINTS_RUN) or name the case whose same sentence is run (HINTS_SAME_AS)")
