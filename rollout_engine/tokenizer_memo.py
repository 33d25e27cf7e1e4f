"""Facts derived from a tokenizer (its special tokens, its byte pieces, its decoder's kind), built once per
tokenizer: a stream or a stop check asks for them per request or per token, and building them walks the
vocabulary or parses the decoder's JSON.

A fact is rebuilt when the tokenizer's length changes: `add_tokens` / `add_special_tokens` (what a chat or tool
setup does after loading) add pieces, and a fact built before them would miss the new ones. Objects that take
no weak reference or no hash are not cached."""
from __future__ import annotations

import functools
import weakref


def per_tokenizer(build):
    """Decorator: `build(tokenizer)` computed once per tokenizer object and length, held only while the
    tokenizer lives."""
    memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(build)
    def cached(tokenizer):
        try:
            size = len(tokenizer)
        except TypeError:  # no length (a proxy may answer hasattr(__len__) and still have none)
            size = None
        try:
            hit = memo.get(tokenizer)
        except TypeError:
            return build(tokenizer)
        if hit is not None and hit[0] == size:
            return hit[1]
        value = build(tokenizer)
        memo[tokenizer] = (size, value)
        return value

    return cached
