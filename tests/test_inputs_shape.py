"""field_problem: the shape check behind every JSON file mlsm reads back. Each message must name
the key, what it must hold and what it holds, so a hand edit is found without a traceback."""

from __future__ import annotations

import pytest

from mlsm.inputs import field_problem

CASES = [  # (data, fields, message or None)
    ({"step": 3, "lam": 0.5, "name": "a"}, {"step": "int", "lam": "number", "name": "text"}, None),
    ({"step": "last"}, {"step": "int"}, "'step' must be an integer, not text (\"last\")"),
    ({"step": 1.5}, {"step": "int"}, "'step' must be an integer, not a number (1.5)"),
    ({"step": True}, {"step": "int"}, "'step' must be an integer, not true or false (true)"),
    ({}, {"lam": "number"}, "'lam' is missing; it must be a number"),
    ({"lam": None}, {"lam": "number"}, "'lam' is missing; it must be a number"),
    ({}, {"lam": "number?"}, None),
    ({"lam": "x"}, {"lam": "number?"}, "'lam' must be a number, not text (\"x\")"),
    ({"v": [1, "b"]}, {"v": "numbers"}, "'v' must be a list of numbers, not a list ([1, \"b\"])"),
    ({"c": {"train": 3}}, {"c.train.steps": "int"}, "'c.train' must be an object"),
    ({"c": {"train": {}}}, {"c.train.steps": "int"}, "'c.train.steps' is missing; it must be an "
                                                     "integer"),
    ({"run": ["a"]}, {"run": "text"}, "'run' must be text, not a list ([\"a\"])"),
    ({"x": "y" * 100}, {"x": "object"}, "'x' must be an object, not text (\"" + "y" * 26 + "...)"),
    ([1, 2], {"x": "int"}, "not a JSON object"),
]


@pytest.mark.parametrize(("data", "fields", "message"), CASES)
def test_field_problem_names_key_expected_and_found(data, fields, message) -> None:
    assert field_problem(data, fields) == message


def test_yaml_merge_keys_work_and_a_repeated_key_is_still_refused() -> None:
    """Recipes may share settings with YAML merge keys (`<<: *base`); the duplicate-key check
    refused them with PyYAML's "could not determine a constructor for the tag ...merge". A key
    the merged mapping also holds is an override, not a duplicate; a key written twice is."""
    import yaml

    from mlsm.inputs import parse_yaml

    text = "base: &b {lr: 1.0e-3, steps: 10}\narm:\n  <<: *b\n  steps: 20\n"
    assert parse_yaml(text) == yaml.safe_load(text)
    assert parse_yaml(text)["arm"] == {"lr": 1e-3, "steps": 20}
    with pytest.raises(yaml.YAMLError, match="duplicate key 'steps'"):
        parse_yaml("arm:\n  <<: {lr: 1}\n  steps: 1\n  steps: 2\n")
