"""The weight-loading report is silenced only where the head is expected to differ."""

from __future__ import annotations

from transformers import BertConfig, BertForMaskedLM, BertModel
from transformers.utils import logging as hf_logging

from mlsm.hf import quiet_head_mismatch

TINY = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32}


def test_quiet_only_for_expected_head_mismatch(tmp_path):
    BertModel(BertConfig(**TINY)).save_pretrained(tmp_path / "bare")
    BertForMaskedLM(BertConfig(**TINY)).save_pretrained(tmp_path / "mlm")
    before = hf_logging.get_verbosity()
    expected = {("bare", True): True, ("bare", False): False, ("mlm", True): False,
                ("mlm", False): True, ("missing", True): False}
    for (folder, with_head), quiet in expected.items():
        with quiet_head_mismatch(tmp_path / folder, with_head=with_head):
            assert (hf_logging.get_verbosity() == hf_logging.ERROR) == quiet, (folder, with_head)
        assert hf_logging.get_verbosity() == before
