"""Stop strings found as an answer's text streams in: one Aho-Corasick automaton over all of a request's stop
strings, so each new character costs a step or two of the automaton however many strings there are and however
long they are (a scan of every string at every token, as before, made a request of many stop strings stall the
server).

The automaton's state after the text so far is the longest end of the text that begins some stop string: that
much is held back from the client, since the next characters may complete a stop string. The text ends before
the first stop string to complete (the longest, where several complete at the same character), as a reader of
the text character by character would stop.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """The automaton of a request's stop strings (non-empty), built once and shared by its samples'
    matchers."""

    def __init__(self, strings: Sequence[str]) -> None:
        self.children: list[dict[str, int]] = [{}]  # the trie: state -> character -> state
        self.depth = [0]  # each state's string length
        ends = [0]  # the length of the stop string a state spells, 0 for none
        for string in strings:
            state = 0
            for character in string:
                if character not in self.children[state]:
                    self.children[state][character] = len(self.children)
                    self.children.append({})
                    self.depth.append(self.depth[state] + 1)
                    ends.append(0)
                state = self.children[state][character]
            ends[state] = len(string)
        # fallback: the state of the longest proper suffix of a state's string; found: the longest stop string
        # that ends a state's string (0: none); breadth first, so shorter states are done first (the root's
        # children fall back to the root)
        self.fallback = [0] * len(self.children)
        self.found = list(ends)
        queue = list(self.children[0].values())
        for state in queue:
            for character, child in self.children[state].items():
                back = self.fallback[state]
                while back and character not in self.children[back]:
                    back = self.fallback[back]
                self.fallback[child] = self.children[back].get(character, 0)
                self.found[child] = ends[child] or self.found[self.fallback[child]]
                queue.append(child)

    def next(self, state: int, character: str) -> int:
        """The state after `character`."""
        while state and character not in self.children[state]:
            state = self.fallback[state]
        return self.children[state].get(character, 0)


class StopMatcher:
    """One sample's place in the automaton: `scan` the text as it grows."""

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self.state = 0
        self.scanned = 0  # characters of the text fed so far

    def scan(self, text: str) -> int | None:
        """Feed the characters `text` (the whole text so far) adds since the last call; returns where the
        first stop string to complete starts, or None."""
        stops = self.stops
        for at in range(self.scanned, len(text)):
            self.state = stops.next(self.state, text[at])
            if length := stops.found[self.state]:
                return at + 1 - length
        self.scanned = len(text)
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text that could begin a stop string (not to be sent yet)."""
        return self.stops.depth[self.state]
