"""StopStringMatcher: held-back text, earliest match, flush, no stops."""

import pytest

from router.stop_strings import StopStringMatcher


def run(stops, deltas):
    m = StopStringMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        text, stopped = m.push(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


def test_no_stops_passes_text_through():
    m = StopStringMatcher(())
    assert m.push("hello") == ("hello", False)
    assert m.flush() == ""


def test_stop_split_across_deltas_is_removed():
    assert run(["END"], ["abc E", "N", "D tail"]) == ("abc ", True)


def test_partial_prefix_is_held_then_released():
    m = StopStringMatcher(["END"])
    assert m.push("abcE") == ("abc", False)
    assert m.push("N") == ("", False)
    assert m.push("x") == ("ENx", False)
    assert m.flush() == ""


def test_held_text_is_flushed_at_end_of_stream():
    assert run(["###"], ["a#", "#"]) == ("a##", False)


def test_earliest_of_several_stops_wins():
    assert run(["world", "lo w"], ["hel", "lo world"]) == ("hel", True)


def test_stop_inside_a_single_delta():
    assert run(["\n\n"], ["one\n\ntwo"]) == ("one", True)


@pytest.mark.parametrize("text", ["abcdef", "a\nb\n\nc", "xyzENDxyz"])
def test_character_by_character_equals_whole(text):
    stops = ["END", "\n\n"]
    whole = run(stops, [text])
    chars = run(stops, list(text))
    assert whole == chars


def test_push_after_stop_is_a_bug():
    m = StopStringMatcher(["x"])
    assert m.push("x") == ("", True)
    with pytest.raises(AssertionError):
        m.push("more")


def test_matched_names_the_stop_that_ended_the_text():
    m = StopStringMatcher(["zz", "END", "EN"])
    assert m.matched is None
    assert m.push("abc E") == ("abc ", False)
    assert m.push("ND zz") == ("", True)
    assert m.matched == "END"  # earliest in the text; "EN" matches there too but is listed later
    m = StopStringMatcher(["stop"])
    m.push("no match here")
    assert m.matched is None


def test_multi_token_messages_are_cut_at_the_token_that_completes_a_stop_string(tokenizer):
    """The worker's --stream-interval sends several tokens per message: the relay keeps the tokens
    up to the one completing a stop string, with the text one-token messages would have given."""
    from common.detokenizer import IncrementalDetokenizer
    from router.relay import decode_message

    ids = tokenizer.encode("The capital of France is Paris. It is a big city.")
    stop = ["Paris"]

    def one_at_a_time():
        detok, stops, text = IncrementalDetokenizer(tokenizer), StopStringMatcher(stop), ""
        for n, token in enumerate(ids, 1):
            kept, piece, stopped, _ = decode_message([token], detok, stops)
            text += piece
            if stopped:
                return ids[:n], text
        raise AssertionError("the stop string never matched")

    want_ids, want_text = one_at_a_time()
    assert want_text == "The capital of France is " and len(want_ids) < len(ids)
    for size in (2, 4, len(ids)):
        detok, stops, got_ids, text = IncrementalDetokenizer(tokenizer), StopStringMatcher(stop), [], ""
        for start in range(0, len(ids), size):
            kept, piece, stopped, n = decode_message(ids[start : start + size], detok, stops)
            assert n == len(kept)
            got_ids += kept
            text += piece
            if stopped:
                break
        assert (got_ids, text, stopped) == (want_ids, want_text, True), size
    # No stop strings: a message is kept whole.
    assert decode_message(ids[:4], IncrementalDetokenizer(tokenizer), StopStringMatcher([]))[3] == 4
    assert decode_message([], IncrementalDetokenizer(tokenizer), StopStringMatcher(stop)) == (
        [],
        "",
        False,
        0,
    )
