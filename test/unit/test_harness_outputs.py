"""The e2e verdict on tokens fails for every way PD can differ from the reference."""

import pytest

from harness.client import Generation
from harness.outputs import assert_same_tokens


def gen(ids, status=200, error=""):
    return Generation(status=status, output_ids=list(ids), error=error)


def test_equal_tokens_pass():
    assert_same_tokens([gen([1, 2]), gen([3])], [gen([1, 2]), gen([3])], "PD")


@pytest.mark.parametrize("ours, message", [
    ([gen([1, 2]), gen([4])], "1/2 PD outputs differ"),
    ([gen([1, 2]), gen([], status=500, error="boom")], "PD requests failed"),
])
def test_a_differing_or_failed_pd_output_fails(ours, message):
    with pytest.raises(AssertionError, match=message):
        assert_same_tokens([gen([1, 2]), gen([3])], ours, "PD")


def test_a_failed_reference_fails():
    with pytest.raises(AssertionError):
        assert_same_tokens([gen([], status=500, error="down")], [gen([1])], "PD")
