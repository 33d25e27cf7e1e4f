"""What the server's logprobs need of a tokenizer: each token's own text and bytes, and where each token's text
starts in a choice's text. (Streams detokenize with rollout_engine.detokenize.IncrementalDetokenizer, shared
with AsyncEngine.stream.)

A token's own text depends on the tokenizer's kind. Byte-level BPE (GPT-2, Llama 3, Qwen): the token decoded
alone, and its bytes through GPT-2's byte alphabet. SentencePiece-style (Llama 2, Mistral): decoding a token
alone strips its leading space, and a byte-fallback piece <0xNN> is one byte, so the text and bytes come from
the piece itself ("▁" is a space). Any other decoder: the token decoded alone.
"""
from __future__ import annotations

import json
import re

from ..detokenize import REPLACEMENT, IncrementalDetokenizer
from ..tokenizer_memo import per_tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's space


def text_offsets(tokenizer, ids) -> list[int]:
    """Where each token's text starts in the text of `ids` decoded: what a stream's detokenizer records."""
    detok = IncrementalDetokenizer(tokenizer, offsets=True)
    detok.push(ids)
    return detok.offsets


def token_strings(tokenizer, ids) -> list[str]:
    """Each token's own text for logprobs ("token_id:N" without a tokenizer); a token that holds part of a
    character reads U+FFFD here, as it does in OpenAI's API (its `bytes` tell the rest)."""
    if tokenizer is None:
        return [f"token_id:{t}" for t in ids]
    if _kind(tokenizer) == "pieces":
        return [b.decode("utf-8", "replace") for b in _piece_bytes(tokenizer, ids)]
    return tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)


def token_bytes(tokenizer, ids) -> list[list[int] | None]:
    """Each token's UTF-8 bytes where the tokenizer can say (byte-level BPE and SentencePiece pieces: exact),
    else its text's."""
    if tokenizer is None:
        return [None] * len(ids)
    kind = _kind(tokenizer)
    if kind == "pieces":
        return [list(b) for b in _piece_bytes(tokenizer, ids)]
    texts = token_strings(tokenizer, ids)
    if kind != "byte_level":
        return [list(text.encode("utf-8")) for text in texts]
    decoder = _byte_decoder()
    out = []
    for piece, text in zip(tokenizer.convert_ids_to_tokens(list(ids)), texts):
        if isinstance(piece, str) and piece and all(ch in decoder for ch in piece) and REPLACEMENT in text:
            out.append([decoder[ch] for ch in piece])  # the raw bytes of a split character
        else:
            out.append(list(text.encode("utf-8")))
    return out


def _piece_bytes(tokenizer, ids) -> list[bytes]:
    """SentencePiece pieces as bytes: <0xNN> is the byte NN, "▁" a space, anything else its own UTF-8."""
    out = []
    for piece in tokenizer.convert_ids_to_tokens(list(ids)):
        if piece is None:  # an id of the model's padded vocabulary that the tokenizer does not have
            out.append(b"")
            continue
        match = _BYTE_PIECE.fullmatch(piece)
        out.append(bytes([int(match[1], 16)]) if match else piece.replace(_SPIECE_SPACE, " ").encode("utf-8"))
    return out


@per_tokenizer  # logprobs ask per token
def _kind(tokenizer) -> str:
    """"byte_level" (the decoder is ByteLevel), "pieces" (SentencePiece-style: Metaspace, or "▁" replaced by a
    space, or byte fallback) or "other"."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer
        if hasattr(tokenizer, "byte_decoder"):
            return "byte_level"
        return "pieces" if hasattr(tokenizer, "sp_model") else "other"
    decoder = backend.decoder
    if decoder is None:
        return "other"
    state = json.loads(decoder.__getstate__())
    steps = state.get("decoders", [state])  # a Sequence's steps, or the one decoder
    types = {d.get("type") for d in steps}
    if "ByteLevel" in types:
        return "byte_level"
    spiece = any(d.get("type") == "Replace" and d.get("pattern", {}).get("String") == _SPIECE_SPACE for d in steps)
    return "pieces" if spiece or types & {"Metaspace", "ByteFallback"} else "other"


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
