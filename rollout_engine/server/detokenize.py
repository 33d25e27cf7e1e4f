"""What the server's logprobs need of a tokenizer: each token's own text and bytes. (Streams detokenize with
rollout_engine.detokenize.IncrementalDetokenizer, shared with AsyncEngine.stream.)"""
from __future__ import annotations

from ..detokenize import REPLACEMENT, IncrementalDetokenizer  # noqa: F401 - the server's streams use it from here


def token_strings(tokenizer, ids) -> list[str]:
    """Each token's own text for logprobs ("token_id:N" without a tokenizer); a token that holds part of a
    character decodes to U+FFFD here, as it does in OpenAI's API (its `bytes` tell the rest)."""
    if tokenizer is None:
        return [f"token_id:{t}" for t in ids]
    return tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)


def token_bytes(tokenizer, ids) -> list[list[int] | None]:
    """Each token's UTF-8 bytes where the tokenizer can say (byte-level BPE: exact), else its text's."""
    if tokenizer is None:
        return [None] * len(ids)
    decoder = _byte_decoder()
    out = []
    for piece, text in zip(tokenizer.convert_ids_to_tokens(list(ids)), token_strings(tokenizer, ids)):
        if isinstance(piece, str) and piece and all(ch in decoder for ch in piece) and REPLACEMENT in text:
            out.append([decoder[ch] for ch in piece])  # the raw bytes of a split character
        else:
            out.append(list(text.encode("utf-8")))
    return out


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER
