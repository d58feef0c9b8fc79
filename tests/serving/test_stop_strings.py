"""The stop-string automaton against the rule it implements, written the slow way: the text ends before the
first stop string to complete (the longest of those completing at the same character), and what could begin
a stop string is held back, whatever the strings and however the text arrives."""

import random

from serving.stop_strings import StopMatcher, StopStrings


def _first_stop(text: str, stops: list[str]) -> int | None:
    for end in range(1, len(text) + 1):
        if ended := [stop for stop in stops if text[:end].endswith(stop)]:
            return end - max(map(len, ended))
    return None


def _held(text: str, stops: list[str]) -> int:
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def test_the_automaton_finds_what_a_character_by_character_reader_finds():
    rng = random.Random(0)
    for trial in range(400):
        stops = list({"".join(rng.choices("ab c", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 8))})
        text = "".join(rng.choices("ab cd", k=rng.randint(0, 40)))
        matcher, fed, found = StopMatcher(StopStrings(stops)), 0, None
        while fed < len(text) and found is None:  # the text arrives in chunks of random sizes
            fed = min(len(text), fed + rng.randint(1, 4))
            found = matcher.scan(text[:fed])
            if found is None:
                assert matcher.held == _held(text[:fed], stops), (stops, text[:fed])
        expected = _first_stop(text, stops)
        assert found == expected, (trial, stops, text)


def test_overlapping_and_nested_stop_strings():
    assert StopMatcher(StopStrings(["cd", "bcd"])).scan("abcd") == 1  # both end at d: the longer wins
    assert StopMatcher(StopStrings(["abcx", "bc"])).scan("abcx") == 1  # bc completes first
    assert StopMatcher(StopStrings(["aab"])).scan("aaab") == 1  # found across a false start
    matcher = StopMatcher(StopStrings(["END", "NOT HERE"]))
    assert matcher.scan("the E") is None and matcher.held == 1
    assert matcher.scan("the EN") is None and matcher.held == 2
    assert matcher.scan("the ENd") is None and matcher.held == 0
    assert matcher.scan("the ENd END") == 8


def test_many_stop_strings_share_one_automaton():
    stops = [f"stop{i:05d}" for i in range(10_000)]
    matcher = StopMatcher(StopStrings(stops))
    assert matcher.scan("it goes on stop0999") is None and matcher.held == 8
    assert matcher.scan("it goes on stop09999!") == 11
