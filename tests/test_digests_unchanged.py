"""Every digest the house move (issue 31) touched is the one recorded before it: the demo model
and each synthetic family, threads and processes, depth 0/1, interleave and prefill-main.  The
records (one per torch CPU capability: fp32 digests depend on the CPU's kernels) were written by
tests/digest_cases.py at fa4ce70, the commit before the move."""
from __future__ import annotations

import json

import pytest
from digest_cases import CASES, record_path, run_case

RECORDED = json.loads(record_path().read_text())


def test_the_record_covers_every_case():
    assert sorted(RECORDED) == sorted(c.name for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_digest_and_tokens_are_the_recorded_ones(case, model_dir):
    assert run_case(case, model_dir) == RECORDED[case.name]
