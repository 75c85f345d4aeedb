"""echo: how a request's names are listed in an error or a log line."""

from __future__ import annotations

from lmi_serve import echo


def test_a_few_names_are_listed_as_before():
    assert echo.names(["b", "a"]) == "['a', 'b']"
    assert echo.unknown({"inputs": 1, "zz": 2, "aa": 3}, {"inputs"}) == ["zz", "aa"]


def test_many_names_are_counted_past_the_first_few_in_sorted_order():
    found = [f"k{i:06d}" for i in range(100_000, 0, -1)]
    listed = echo.names(found)
    assert listed == repr([f"k{i:06d}" for i in range(1, 9)]) + " and 99,992 more"
    assert echo.first(found) == "k000001"


def test_a_long_name_is_cut():
    listed = echo.names(["n" * 10_000])
    assert len(listed) < 80 and listed.endswith("…']")
    assert echo.first([]) is None


def test_a_listing_keeps_order_and_counts_the_rest():
    assert echo.listing(["b: bad", "a: bad"]) == "b: bad; a: bad"
    many = echo.listing([f"p{i}: {'v' * 1000}" for i in range(20)])
    assert many.startswith("p0: ") and many.endswith("; and 12 more") and len(many) < 9 * echo.TEXT_CHARS
