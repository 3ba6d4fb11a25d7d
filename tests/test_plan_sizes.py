"""Reading sizes, counts and bandwidths: decimal and binary units kept apart, bad text refused."""

import pytest

from phalanx.planner.hardware import LINKS
from phalanx.planner.sizes import (
    format_bytes,
    format_count,
    parse_bandwidth,
    parse_bytes,
    parse_count,
)

pytestmark = pytest.mark.one_process  # starts no process (tests/conftest.py)


@pytest.mark.parametrize("text,expected", [
    ("80GB", 80 * 10**9), ("80 GB", 80 * 10**9), ("80gb", 80 * 10**9), ("80GiB", 80 * 2**30),
    ("1.5TB", 1.5e12), ("512MiB", 512 * 2**20), ("40G", 40 * 10**9), (1024, 1024),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("8e9", 8 * 10**9), ("8B", 8 * 10**9), ("7.5b", 7_500_000_000), ("125M", 125 * 10**6),
    ("350k", 350_000), ("8_000_000_000", 8 * 10**9), (1.3e9, 1_300_000_000), ("1T", 10**12),
])
def test_parse_count(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("nvlink4", 450.0), ("PCIe4", 32.0), ("ib-400g", 50.0), ("eth-25g", 3.125),
    ("450", 450.0), ("50GB/s", 50.0), ("400Gb/s", 50.0), ("400Gbps", 50.0), (12.5, 12.5),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text, LINKS) == expected


@pytest.mark.parametrize("fn,text,message", [
    (parse_bytes, "80", "has no unit"),
    (parse_bytes, "eighty GB", "cannot read"),
    (parse_bytes, "80QB", "unknown unit"),
    (parse_count, "8 billion", "cannot read"),
    (parse_count, "0", "at least 1"),
    (parse_count, -5, "must be positive"),
    (lambda t: parse_bandwidth(t, LINKS), "infiniband", "unknown bandwidth 'infiniband'"),
    (lambda t: parse_bandwidth(t, LINKS), "0", "must be positive"),
])
def test_bad_text_is_refused_with_the_cause(fn, text, message):
    with pytest.raises(ValueError, match=message):
        fn(text)


def test_formatting_labels_its_unit():
    assert format_bytes(80 * 10**9, "GB") == "80.0 GB"
    assert format_bytes(80 * 10**9, "GiB") == "74.5 GiB"
    assert format_count(7.5e9) == "7.5B"
    assert format_count(124_439_808) == "124.4M"
