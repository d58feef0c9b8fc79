"""Incremental detokenization: the text each new token adds, decoding a few recent tokens per step, not all of
them.

Follows vLLM's `detokenize_incrementally` (and transformers' TextStreamer): a short window of recent tokens is
decoded with and without the newest ones, and the difference is the new text, so tokenizers whose output
depends on context (SentencePiece's leading space, byte-level BPE characters cut across tokens) give exactly
the text that decoding everything at once gives. Text that ends in a cut character (U+FFFD) waits for the next
token.
"""

from __future__ import annotations

from collections.abc import Iterable

CUT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids as they come (`add`, then `finish`); `text` is everything decoded so far."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""
        self._window = 0  # the decoding window starts here ...
        self._read = 0  # ... and the tokens before this are in `text`

    def add(self, token_ids: Iterable[int]) -> str:
        """Take new tokens; returns the text they complete ("" while a character is still cut)."""
        self.tokens.extend(token_ids)
        new = self._pending()
        return "" if not new or new.endswith(CUT_CHARACTER) else self._take(new)

    def finish(self) -> str:
        """The text still held back (a character the last tokens left cut, as U+FFFD): call when no tokens
        follow."""
        return self._take(self._pending())

    def _pending(self) -> str:
        """The text the tokens after `_read` add: the window decoded with them, less the window decoded
        without."""
        before = self._decode(self.tokens[self._window : self._read])
        return self._decode(self.tokens[self._window :])[len(before) :]

    def _take(self, new: str) -> str:
        self._window, self._read = self._read, len(self.tokens)
        self.text += new
        return new

    def _decode(self, token_ids: list[int]) -> str:
        return (
            self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
            if token_ids
            else ""
        )
