"""The converted-BERT client logs predictions within the measured encrypted error."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from defense_suite.crypto.conversion.error import expected_logit_error
from defense_suite.crypto.he.ckks import INTERACTIVE, NON_INTERACTIVE
from defense_suite.crypto.protocol.encoder_client import BertClient


def _client(params: object) -> SimpleNamespace:
    config = SimpleNamespace(n_layers=2, d=8)
    return SimpleNamespace(bert=SimpleNamespace(config=config), params=params)


def test_close_margins_are_logged_and_clear_ones_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = expected_logit_error(2, 8)
    logits = np.array([[1.0, 1.0 + error], [0.0, 1.0], [3.0, 0.0]])
    with caplog.at_level(
        logging.WARNING, logger="defense_suite.crypto.protocol.encoder_client"
    ):
        BertClient._warn_uncertain(_client(INTERACTIVE), logits)  # type: ignore[arg-type]
    assert len(caplog.records) == 1
    assert "1 of 3 predictions" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(
        logging.WARNING, logger="defense_suite.crypto.protocol.encoder_client"
    ):
        BertClient._warn_uncertain(_client(INTERACTIVE), logits[1:])  # type: ignore[arg-type]
    assert not caplog.records


def test_no_claim_for_parameters_the_table_was_not_measured_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logits = np.zeros((2, 2))
    with caplog.at_level(
        logging.WARNING, logger="defense_suite.crypto.protocol.encoder_client"
    ):
        BertClient._warn_uncertain(_client(NON_INTERACTIVE), logits)  # type: ignore[arg-type]
    assert not caplog.records
