"""What generate() accepts, checked whole before the engine changes anything: prompts and SamplingParams.

A prompt is a string (tokenized with the checkpoint's tokenizer), a list of token ids (a 1-D numpy or
torch integer array too), or vLLM's {"prompt_token_ids": [...]}; `prompts` is one prompt or a list.
"""
from __future__ import annotations

import dataclasses
import numbers

from .sampling_params import SamplingParams, check_unicode
from .stop_strings import special_stop_ids, special_tokens
from .tokenizer_memo import per_tokenizer

PROMPT_FORMS = ("a str", "a list of token ids", "a 1-D integer array", '{"prompt_token_ids": [...]}')


def one_prompt(prompt) -> bool:
    """Whether `prompt` is a single prompt (a string, a list or 1-d array of token ids, a dict) and not a list."""
    if isinstance(prompt, (str, dict)) or hasattr(prompt, "ndim") and prompt.ndim == 1:
        return True
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and (isinstance(prompt[0], numbers.Number) or getattr(prompt[0], "ndim", None) == 0))


def integer_dtype(dtype) -> bool:
    """A numpy or torch integer dtype (not bool, not floating)."""
    kind = getattr(dtype, "kind", None)  # numpy's; torch dtypes have none
    return kind in ("i", "u") if kind is not None else str(dtype).removeprefix("torch.").startswith(("int", "uint"))


def _token_ids(prompt) -> list:
    if isinstance(prompt, dict):
        if set(prompt) != {"prompt_token_ids"}:
            raise ValueError(f"a dict prompt must be {{'prompt_token_ids': [...]}} alone, got keys {sorted(prompt)}")
        prompt = prompt["prompt_token_ids"]
    if hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):  # numpy or torch
        if prompt.ndim != 1 or not integer_dtype(prompt.dtype):
            raise ValueError(f"an array prompt must be 1-D of integer token ids, got {prompt.ndim}-D {prompt.dtype}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt of type {type(prompt).__name__} is not allowed; a prompt is one of {PROMPT_FORMS}")
    return token_values(prompt)


def token_values(ids) -> list:
    """`ids` with each 0-d integer tensor as its value: list(tensor) gives 0-d tensors, which are no
    numbers.Integral (numpy's scalars are), and each pickles its whole tensor's storage."""
    return [t.item() if getattr(t, "ndim", None) == 0 and integer_dtype(t.dtype) else t for t in ids]


# A normalizer may fold a few characters into one before the pieces are matched (NFKC, combining marks): a
# text longer than this many times the longest piece per token surely tokenizes past the limit.
NORMALIZER_SLACK = 4


@per_tokenizer
def longest_piece(tokenizer) -> int:
    """The most characters one token's piece holds (byte-level BPE: one per byte; SentencePiece: one per
    character, byte pieces <0xNN> six for one byte): a token covers at most that many characters of text."""
    pieces = list(tokenizer.get_vocab()) + [str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    return max(map(len, pieces), default=1)


def check_text_length(text: str, tokenizer, max_seq_len: int, name: str = "prompt") -> None:
    """Refuse a text too long to fit before tokenizing it: tokenizing tens of megabytes to count its tokens takes
    minutes and gigabytes (a 20 MB body: 37 s and 4 GB in the server's front, its event loop held)."""
    check_characters(len(text), tokenizer, max_seq_len, name)


def check_characters(characters: int, tokenizer, max_seq_len: int, name: str) -> None:
    """check_text_length for `characters` of text that will all be tokenized (a conversation's strings)."""
    bound = NORMALIZER_SLACK * max_seq_len * longest_piece(tokenizer)
    if characters > bound:
        raise ValueError(f"{name} has {characters} characters, more than {max_seq_len} tokens can hold here (at most "
                         f"{bound} characters: {longest_piece(tokenizer)} a token, times {NORMALIZER_SLACK})")


def prompt_ids(prompt, tokenizer, vocab_size: int, max_seq_len: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt, checked against the vocabulary and the longest sequence."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this checkpoint has none: pass token ids")
        check_unicode(prompt, "prompt")
        check_text_length(prompt, tokenizer, max_seq_len)
        text, ids = prompt, tokenizer(prompt)["input_ids"]
    else:
        text, ids = None, _token_ids(prompt)
    if not ids:
        raise ValueError("prompt is empty; every prompt needs at least one token")
    if len(ids) > max_seq_len:  # before any per-id work: a server's 60 MB body of ids is refused at once
        raise ValueError(f"prompt has {len(ids)} tokens; sequences hold at most {max_seq_len} tokens here "
                         f"(max_model_len, or the KV pool if smaller), so at most {max_seq_len} prompt tokens (a "
                         "prompt of that many is scored and gets one token, finish_reason 'length')")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are not ints in [0, {vocab_size})")
    return text, [int(t) for t in ids]


def normalise(prompts, sampling_params, tokenizer, vocab_size: int, max_seq_len: int):
    """[(text, ids)] and one validated SamplingParams per prompt."""
    if one_prompt(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be one prompt or a non-empty list of prompts; a prompt is one of "
                         f"{PROMPT_FORMS}")
    params = sampling_params if sampling_params is not None else SamplingParams()
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("sampling_params must be one SamplingParams or a list with one per prompt")
    stopping = {}  # id of a caller's SamplingParams -> the one to run (a copy when a stop is a special token)
    for p in {id(p): p for p in params}.values():
        p.validate()  # fields may have changed since construction
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(p, name) or 0) > vocab_size:
                raise ValueError(f"sampling_params.{name}={getattr(p, name)} asks for more alternatives than the "
                                 f"model's {vocab_size} tokens; at most {vocab_size}")
        outside = [t for t in p.stop_token_ids if t >= vocab_size]
        if outside:  # a token the model cannot produce never stops anything: most likely another tokenizer's id
            raise ValueError(f"sampling_params.stop_token_ids {outside[:5]} are outside the model's vocabulary; "
                             f"token ids are in [0, {vocab_size})")
        if tokenizer is None and p.stop:
            raise ValueError("stop strings need a tokenizer; this checkpoint has none: use stop_token_ids")
        extra = [i for i in special_stop_ids(p.stop, special_tokens(tokenizer)) if i not in p.stop_token_ids] \
            if p.stop else []
        stopping[id(p)] = dataclasses.replace(p, stop_token_ids=p.stop_token_ids + extra) if extra else p
    return [prompt_ids(p, tokenizer, vocab_size, max_seq_len) for p in prompts], [stopping[id(p)] for p in params]


def load_tokenizer(path):
    """The checkpoint's tokenizer, or None when it ships none; unreadable files are a ValueError naming them."""
    files = [path / f for f in ("tokenizer.json", "tokenizer_config.json") if (path / f).is_file()]
    if not files:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises bare Exceptions for bad JSON
        raise ValueError(f"the tokenizer files {[str(f) for f in files]} cannot be loaded: {err}") from err


def check_draft_tokenizer(tokenizer, draft_path) -> None:
    """A draft checkpoint whose tokenizer gives tokens other ids than the target's is refused: its proposals would
    name other tokens, so nearly all would be rejected (the output stays the target's, only slower). A draft that
    ships no tokenizer is taken on its vocabulary size alone."""
    draft = load_tokenizer(draft_path) if tokenizer is not None and draft_path is not None else None
    if draft is None:
        return
    ours, theirs = tokenizer.get_vocab(), draft.get_vocab()
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise ValueError(f"draft_model's tokenizer ({draft_path}) differs from the target's: {differ} (token, id) "
                         f"pairs are in one and not the other; a draft must share the target's tokenizer")
