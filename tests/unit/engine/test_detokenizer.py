"""IncrementalDetokenizer: exact text, no U+FFFD, stop strings never partially released."""

from __future__ import annotations

import pytest

from lmi_serve.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Café ☕ naïve 東京 🚀🎉",
    "🚀🎉👩‍👩‍👧 emoji only 🇫🇷",
    "   leading spaces and  double  spaces ",
    "Plain ASCII sentence, with punctuation!\nAnd a second line.\t(tab)",
    "Ünïcödé mixed with ascii: ß, Ω, ж, 한국어, العربية",
]


class SlowTokenizer:
    """Wraps a tokenizer but hides `backend_tokenizer`, forcing the decode-and-diff fallback."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.decode_calls = 0

    def decode(self, ids, skip_special_tokens=False):
        self.decode_calls += 1
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(params=["fast", "slow"])
def make_tokenizer(request, smollm2_tokenizer):
    """Returns (tokenizer handed to the detokenizer, real tokenizer for reference decoding)."""
    if request.param == "fast":
        assert getattr(smollm2_tokenizer, "backend_tokenizer", None) is not None
        return smollm2_tokenizer
    slow = SlowTokenizer(smollm2_tokenizer)
    assert not hasattr(slow, "backend_tokenizer")
    return slow


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def run(detok, ids):
    """Feed ids; return (list of releases, index of the token that hit a stop or None)."""
    releases = []
    for i, token_id in enumerate(ids):
        piece, stop = detok.add(token_id)
        releases.append(piece)
        if stop:
            return releases, i
    releases.append(detok.flush())
    return releases, None


@pytest.mark.parametrize("text", TEXTS)
def test_releases_concatenate_to_full_decode(make_tokenizer, smollm2_tokenizer, text):
    ids = encode(smollm2_tokenizer, text)
    detok = IncrementalDetokenizer(make_tokenizer)
    releases, stop_at = run(detok, ids)
    assert stop_at is None
    expected = smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(releases) == expected == text
    assert detok.text == expected
    for piece in releases:
        assert "\ufffd" not in piece


def test_multibyte_tokens_hold_back_partial_characters(make_tokenizer, smollm2_tokenizer):
    # "☕" is split over several byte-level tokens; no single one may release anything broken.
    ids = encode(smollm2_tokenizer, "☕")
    assert len(ids) > 1, "test premise: the character spans several tokens"
    detok = IncrementalDetokenizer(make_tokenizer)
    pieces = [detok.add(t)[0] for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "☕"
    assert detok.flush() == ""


def test_fast_path_matches_prefix_decode_at_every_step(smollm2_tokenizer):
    # Without stop strings nothing is held back except incomplete characters.
    text = "Hi 東京, ok 🚀 done"
    ids = encode(smollm2_tokenizer, text)
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    released = ""
    for k, token_id in enumerate(ids, start=1):
        released += detok.add(token_id)[0]
        prefix = smollm2_tokenizer.decode(ids[:k], skip_special_tokens=True)
        if not prefix.endswith("\ufffd"):
            assert released == prefix


def test_special_tokens_give_no_text(make_tokenizer, smollm2_tokenizer):
    tok = smollm2_tokenizer
    specials = sorted(set(tok.all_special_ids))
    assert specials, "tokenizer has special tokens"
    ids = [tok.bos_token_id] + encode(tok, "Hi 東京") + specials + encode(tok, " there") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(make_tokenizer)
    releases = []
    for token_id in ids:
        piece, stop = detok.add(token_id)
        assert not stop
        if token_id in specials:
            assert piece == ""
        releases.append(piece)
    releases.append(detok.flush())
    assert "".join(releases) == "Hi 東京 there" == tok.decode(ids, skip_special_tokens=True)


def test_only_special_tokens_yield_empty_text(make_tokenizer, smollm2_tokenizer):
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(make_tokenizer)
    assert [detok.add(t) for t in (tok.bos_token_id, tok.eos_token_id)] == [("", False), ("", False)]
    assert detok.flush() == ""


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_prefix_seen_earlier_is_released_but_stop_is_never_partially_released(
        make_tokenizer, smollm2_tokenizer, include_stop):
    tok = smollm2_tokenizer
    stop = "###DONE"
    text = "a ## b ###DON c ###DONE tail that must not appear"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(make_tokenizer, [stop], include_stop_str=include_stop)
    releases, stop_at = run(detok, ids)
    assert stop_at is not None
    out = "".join(releases)
    cut = text.index(stop) + (len(stop) if include_stop else 0)
    assert out == text[:cut]
    assert detok.text == out
    # The earlier partial matches "##" and "###DON" were released before the real stop arrived.
    decoded_before_hit = tok.decode(ids[:stop_at], skip_special_tokens=True)
    released_before_hit = "".join(releases[:-1])
    assert "###DON " in released_before_hit
    assert not any(released_before_hit.endswith(stop[:n]) for n in range(1, len(stop)))
    # Exactly len(stop) - 1 characters were held back before the stop completed.
    assert released_before_hit == decoded_before_hit[:len(decoded_before_hit) - (len(stop) - 1)]


def test_hold_back_is_exactly_longest_stop_minus_one(smollm2_tokenizer):
    tok = smollm2_tokenizer
    stops = ["XY", "<STOP>"]  # longest has 6 characters -> hold 5
    text = "one two three four five six seven"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, stops)
    released = ""
    for k, token_id in enumerate(ids, start=1):
        piece, stop = detok.add(token_id)
        assert not stop
        released += piece
        prefix = tok.decode(ids[:k], skip_special_tokens=True)
        assert released == prefix[:max(0, len(prefix) - 5)]
    assert released + detok.flush() == text


@pytest.mark.parametrize("include_stop,expected", [(False, "Hel"), (True, "Hello w")])
def test_stop_inside_a_token(make_tokenizer, smollm2_tokenizer, include_stop, expected):
    ids = encode(smollm2_tokenizer, "Hello world, again")
    detok = IncrementalDetokenizer(make_tokenizer, ["lo w"], include_stop_str=include_stop)
    releases, stop_at = run(detok, ids)
    assert stop_at is not None
    assert "".join(releases) == expected


def test_multibyte_stop_string(make_tokenizer, smollm2_tokenizer):
    text = "Café ☕ naïve 東京 🚀🎉"
    ids = encode(smollm2_tokenizer, text)
    detok = IncrementalDetokenizer(make_tokenizer, ["東京"])
    releases, stop_at = run(detok, ids)
    assert stop_at is not None
    assert "".join(releases) == "Café ☕ naïve "
    assert all("\ufffd" not in piece for piece in releases)


def test_earliest_of_several_stops_wins(make_tokenizer, smollm2_tokenizer):
    text = "alpha beta gamma delta"
    ids = encode(smollm2_tokenizer, text)
    detok = IncrementalDetokenizer(make_tokenizer, ["delta", "beta"])
    assert detok.stopped_by is None
    releases, stop_at = run(detok, ids)
    assert stop_at is not None
    assert "".join(releases) == "alpha "
    assert detok.stopped_by == "beta"  # which one ended it (Anthropic's `stop_sequence` names it)


def test_stop_not_present_releases_everything_on_flush(make_tokenizer, smollm2_tokenizer):
    text = "no stop here 🚀"
    ids = encode(smollm2_tokenizer, text)
    detok = IncrementalDetokenizer(make_tokenizer, ["ZZZZZZ", ""])
    releases, stop_at = run(detok, ids)
    assert stop_at is None
    assert releases[-1] != ""  # something was held back until flush
    assert "".join(releases) == text


def test_empty_stop_strings_are_ignored(make_tokenizer, smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "abc")
    detok = IncrementalDetokenizer(make_tokenizer, [""])
    releases, stop_at = run(detok, ids)
    assert stop_at is None
    assert "".join(releases) == "abc"
    assert releases[-1] == ""  # no hold-back without real stop strings


def test_slow_path_is_used_without_backend_tokenizer(smollm2_tokenizer):
    slow = SlowTokenizer(smollm2_tokenizer)
    detok = IncrementalDetokenizer(slow)
    for token_id in encode(smollm2_tokenizer, "abc 東京"):
        detok.add(token_id)
    assert slow.decode_calls > 0


class RecordingTokenizer:
    """A slow tokenizer that shows each call's options in its output."""

    def __init__(self):
        self.options = []

    def decode(self, ids, **options):
        self.options.append(options)
        return "x" * len(ids)


@pytest.mark.parametrize("spaces", [True, False])
def test_slow_path_hands_special_token_options_to_decode(spaces):
    tok = RecordingTokenizer()
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert detok.add(5) == ("x", False)
    expected = {"skip_special_tokens": False}
    if not spaces:
        expected["spaces_between_special_tokens"] = False
    assert tok.options == [expected]


def test_fast_path_without_spaces_writes_consecutive_special_tokens_bare(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "hi<|im_end|><|im_start|>user")
    detok = IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(run(detok, ids)[0]) == "hi<|im_end|><|im_start|>user"
    shown = IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=False)
    assert "".join(run(shown, ids)[0]) == smollm2_tokenizer.decode(ids, skip_special_tokens=False)
    hidden = IncrementalDetokenizer(smollm2_tokenizer)
    assert "".join(run(hidden, ids)[0]) == "hiuser"


def test_stop_strings_skipped_while_not_checked_are_not_found_later(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "stop here and stop there")
    detok = IncrementalDetokenizer(smollm2_tokenizer, ["stop"])
    released = ""
    for i, token_id in enumerate(ids):
        piece, stopped = detok.add(token_id, check_stops=i >= 3)
        released += piece
        if stopped:
            break
    assert stopped and released == detok.text == "stop here and "  # the first "stop" went by unchecked
