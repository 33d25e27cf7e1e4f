"""Facts derived from a tokenizer (its special tokens, its byte pieces, its decoder's kind), built once per
tokenizer: a stream or a stop check asks for them per request or per token, and building them walks the
vocabulary or parses the decoder's JSON.

A fact is rebuilt when the tokenizer's length or its special tokens change: `add_tokens` /
`add_special_tokens` (what a chat or tool setup does after loading) add pieces, or mark a piece the tokenizer
has special, and a fact built before them would miss the change. Objects that take no weak reference or no
hash are not cached."""
from __future__ import annotations

import functools
import weakref


def per_tokenizer(build):
    """Decorator: `build(tokenizer)` computed once per tokenizer object and state (`_state`), held only while
    the tokenizer lives."""
    memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(build)
    def cached(tokenizer):
        try:
            hit = memo.get(tokenizer)
        except TypeError:
            return build(tokenizer)
        if hit is not None and hit[0] == _state(tokenizer, hit[1]):
            return hit[2]
        plain = _plain_added_ids(tokenizer)
        value = build(tokenizer)
        memo[tokenizer] = (_state(tokenizer, plain), plain, value)
        return value

    return cached


def _plain_added_ids(tokenizer) -> list[int]:
    """The added tokens not marked special: `add_tokens(..., special_tokens=True)` can mark one special later,
    which changes neither the length nor `all_special_ids`. Reading every added token's flag costs tens of
    microseconds (Llama 3's 256), too much for each call."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted(int(i) for i, token in added.items() if not getattr(token, "special", False))


def _state(tokenizer, plain: list[int]):
    """What a fact is valid for, read in microseconds: the length, the special ids, and the text of the added
    tokens that were plain when it was built (one marked special since drops out of it)."""
    try:
        size = len(tokenizer)
    except TypeError:  # no length (a proxy may answer hasattr(__len__) and still have none)
        size = None
    special_ids = tuple(getattr(tokenizer, "all_special_ids", None) or ())
    text = tokenizer.decode(plain, skip_special_tokens=True) if plain else ""
    return size, special_ids, text
