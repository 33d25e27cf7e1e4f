"""What a stream holds back: the tail of the text so far that may still become one of some words."""
from __future__ import annotations


def unfinished_tail(text: str, words) -> int:
    """The length of the longest tail of `text` that is a proper start of one of `words` (0: none). A stream
    holds it back until the next text shows whether the word follows (a stop string, a tag)."""
    return max((next((k for k in range(min(len(w) - 1, len(text)), 0, -1) if text.endswith(w[:k])), 0)
                for w in words), default=0)
