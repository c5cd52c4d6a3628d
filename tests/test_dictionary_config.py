"""Each dictionary setting is declared once (issue 33, item 3): every field of
`mlsm.teacher.dictionary_config.DictionaryConfig` is a flag of `mlsm dictionary` (same default), a
keyword
of `learn_dictionary` and a key of a study's `dictionary:` group, and a value given in any of the
three reaches the config the learner runs with. No teacher is loaded: `learn_dictionary` builds its
config before it looks at the teacher, so a refused teacher shows the keyword was accepted."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from mlsm.cli import build_parser
from mlsm.cli.dataclass_flags import flag_values
from mlsm.defaults import SAMPLINGS
from mlsm.errors import UserError
from mlsm.teacher.dictionary_config import DictionaryConfig

FIELDS = dataclasses.fields(DictionaryConfig)


def _other(f: dataclasses.Field) -> object:
    """A valid value of field f that is not its default."""
    default = f.default
    hint = typing.get_type_hints(DictionaryConfig)[f.name]
    if typing.get_origin(hint) is typing.Literal:  # atoms, teacher_init
        return next(s for s in typing.get_args(hint) if s != default)
    if isinstance(default, str):
        return next(s for s in SAMPLINGS if s != default)
    if isinstance(default, float):
        return default / 2
    if isinstance(default, int):
        return default + 3
    return 7  # int | None, None by default


OTHER = {f.name: _other(f) for f in FIELDS}
BASE_ARGS = ["dictionary", "--store", "s", "--out", "d.safetensors"]


def _parse(extra: list[str]) -> tuple[object, object]:
    parser, _ = build_parser()
    return parser.parse_args([*BASE_ARGS, *extra])


def test_every_setting_is_a_flag_with_the_dataclass_default() -> None:
    args = _parse([])
    assert flag_values(args, DictionaryConfig) == {}  # not given: the dataclass's default applies
    given = [t for name, value in OTHER.items()
             for t in (f"--{name.replace('_', '-')}", str(value))]
    assert flag_values(_parse(given), DictionaryConfig) == OTHER
    # the defaults `mlsm dictionary` ran with before the flags were generated
    assert (DictionaryConfig().n_vectors, DictionaryConfig().max_len, DictionaryConfig().lam,
            DictionaryConfig().batch_size, DictionaryConfig().sampling) == (
        2_000_000, 128, 0.05, 512, "windows")


@pytest.mark.parametrize("flag", ["--lam 1", "--max-len 2", "--sampling random", "--k 0"])
def test_a_flag_out_of_its_fields_range_is_refused(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parse(flag.split())
    assert exit_.value.code == 2 and flag.split()[0] in capsys.readouterr().err


@pytest.mark.parametrize("name", [f.name for f in FIELDS])
def test_every_setting_is_a_keyword_of_learn_dictionary(name: str) -> None:
    from mlsm.teacher.dictionary import learn_dictionary

    with pytest.raises(UserError, match="takes a Teacher"):  # the keyword was accepted
        learn_dictionary(None, object(), **{name: OTHER[name]})
    with pytest.raises(UserError, match="takes a Teacher"):
        learn_dictionary(None, object(), DictionaryConfig(**{name: OTHER[name]}))


def test_learn_dictionary_refuses_unknown_and_out_of_range_settings() -> None:
    from mlsm.teacher.dictionary import learn_dictionary

    with pytest.raises(UserError, match="unknown key learn_dictionary\\(\\).n_vector"):
        learn_dictionary(None, object(), n_vector=5)
    with pytest.raises(UserError, match="lam must be in \\(0, 1\\)"):
        learn_dictionary(None, object(), lam=2.0)


def _study(tmp_path, group: dict, arm_dictionary: dict) -> object:
    from mlsm.study.spec import study_from_dict

    return study_from_dict({"out": str(tmp_path), "dictionary": group,
                            "arms": {"m": {"objective": {"name": "mlsm"},
                                           "dictionary": arm_dictionary}}})


def test_every_setting_is_a_study_dictionary_key(tmp_path) -> None:
    from mlsm.study.spec import DictionarySpec, arm_dictionary

    assert {f.name for f in FIELDS} <= {f.name for f in dataclasses.fields(DictionarySpec)}
    # a study keeps its own smaller default
    assert DictionarySpec().n_vectors == 200_000
    spec = _study(tmp_path, {**OTHER, "n_vectors": 50_000}, {})
    assert dataclasses.asdict(arm_dictionary(spec, "m")) == {**OTHER, "n_vectors": 50_000}
    # the arm's own k and lam win over the group's
    spec = _study(tmp_path, {**OTHER, "n_vectors": 50_000}, {"k": 11, "lam": 0.3})
    got = arm_dictionary(spec, "m")
    assert (got.k, got.lam, got.seed) == (11, 0.3, OTHER["seed"])


def test_a_study_dictionary_fingerprint_is_unchanged_by_defaults(tmp_path) -> None:
    """Settings a study could not set before hash only when given, so older studies' dictionaries
    are not learned again."""
    from mlsm.study.folder import Study
    from mlsm.study.reuse import dictionary_settings

    old = {"teacher": "", "layer": 5, "k": None, "lam": 0.05, "n_vectors": 200_000,
           "max_len": 128, "seed": 0}
    assert dictionary_settings(Study(_study(tmp_path, {}, {"layer": 5})), "m") == old
    study = Study(_study(tmp_path, {"sampling": "documents", "batch_size": 64}, {}))
    assert dictionary_settings(study, "m") == {**old, "sampling": "documents", "batch_size": 64}
