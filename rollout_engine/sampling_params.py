"""SamplingParams: what one request asks for, validated on construction and again by generate()."""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch

from rollout_kernels.sampling import token_logprobs_ref

LOGPROBS_MODES = ("processed", "temperature", "raw")
# Samples of one prompt: each is a record for its caller before any step runs. Far above RL groups (8-64), and
# room for sampling-distribution checks (thousands of draws of one prompt).
MAX_N = 16384
SEED_LIMIT = 2 ** 63  # seeds are int64-sized and not negative: [0, SEED_LIMIT)
SEED_RANGE = "an int in [0, 2**63)"  # SEED_LIMIT in words, for the errors of every seed argument
MAX_STOPS = 64  # stop strings a request may give, each of at most MAX_STOP_CHARS characters
MAX_STOP_CHARS = 1024
MAX_LOGPROBS = 20  # the most top-k alternatives `logprobs` and `prompt_logprobs` may ask for (OpenAI's and vLLM's)
# Sampling runs in float32 with top_k in int32: a temperature below MIN_TEMPERATURE turns logits of a few units
# into inf, a top_p below float32's smallest normal rounds to 0 (nothing kept), a top_k of 2**31 overflows.
MIN_TEMPERATURE = 1e-5
# Above MAX_TEMPERATURE a draw is uniform over what top-k / top-p / min-p keep, to within 1e-4 for logits of
# +-100; past float32's largest number (3.4e38) the temperature becomes inf, every logit 0, and the filters
# would silently keep every token.
MAX_TEMPERATURE = 1e6
MIN_TOP_P = 2.0 ** -126
TOP_K_LIMIT = 2 ** 31
# vLLM's sampling fields the engine does not implement, with the values that ask for nothing (what it does anyway):
# code and clients written for vLLM pass them at those values, taken and dropped; any other value is refused.
NEUTRAL = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
           "best_of": (None, 1), "repetition_penalty": (None, 1, 1.0), "min_tokens": (None, 0),
           "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
           "truncate_prompt_tokens": (None,), "include_stop_str_in_output": (None, False), "detokenize": (None, True)}


def check_neutral(name: str, value, neutral=NEUTRAL, n=None) -> None:
    """ValueError unless `value` is one of `name`'s neutral values (of the same type: 1.0 is not True; a numpy
    scalar as its Python value). vLLM's best_of equal to the request's `n` is neutral too: n drawn, all n
    returned, which is what the engine does."""
    if name == "best_of" and is_int(value) and is_int(n) and value <= n:
        if value < n:  # OpenAI's rule: best_of draws, n of them returned
            raise ValueError(f"best_of={value!r} is less than n={n!r}; best_of must be at least n (leave it out)")
        return
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()
    if not any(value == v and type(value) is type(v) or value is v for v in neutral[name]):
        raise ValueError(f"{name}={value!r} is not supported by this engine; leave it out")


@dataclass
class SamplingParams:
    """What one request asks for.

    Logprobs. `logprobs=None`: none (`CompletionOutput.logprobs` is None); `0` (the default): each sampled
    token's logprob; `k` in 1..MAX_LOGPROBS: also `CompletionOutput.top_logprobs[t]`, the k most likely tokens of
    the same distribution as {token_id: logprob}. `True`/`False` mean 0/None. `logprobs_mode` says which
    distribution, at a sampled position:
      "processed"   the one the token was drawn from: log_softmax(logits / temperature) with the tokens dropped by
                    top-k, top-p and min-p at -inf, renormalised over the tokens kept;
      "temperature" log_softmax(logits / temperature) over the whole vocabulary (before any truncation);
      "raw"         log_softmax(logits).
    Temperature 0 (greedy) divides by 1. With no top-k/top-p/min-p, "processed" and "temperature" are equal.
    The filters keep ties whole, so the kept set never depends on token order: top-k keeps every token at least
    as likely as the k-th, top-p every token whose strictly likelier tokens hold less than top_p of the mass,
    min-p every token at least min_p times as likely as the top one.

    `prompt_logprobs=None` (the default): none; `k` in 0..MAX_LOGPROBS: `RequestOutput.prompt_logprobs`, one entry
    per prompt token, None at position 0, then {prompt token t: its logprob given the tokens before it} plus the
    k most likely tokens there (how given sequences are scored: `max_tokens=1`). A prompt token was not sampled,
    so no truncation applies: "processed" and "temperature" give log_softmax(logits / temperature) (1 when
    temperature is 0; at the default temperature 1 this is the model's plain log-softmax), "raw" gives
    log_softmax(logits). A request that asks for prompt logprobs computes its whole prompt (no prefix-cache hit),
    since a cached position has no logits.

    vLLM's sampling fields the engine does not implement (NEUTRAL: presence_penalty, repetition_penalty,
    min_tokens, skip_special_tokens, ...) are taken at the values that ask for nothing, in the constructor or set
    afterwards, and refused otherwise; nothing else that is not a field may be set."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 256
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = 0
    prompt_logprobs: int | None = None
    logprobs_mode: str = "processed"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field (and normalise `stop` to a list); a field set after construction is checked too."""
        def bad(arg, allowed):
            raise ValueError(f"{arg}={getattr(self, arg)!r} is not allowed; {arg} must be {allowed}")

        for name in ("n", "top_k", "max_tokens", "seed"):  # numpy integers become ints (hashable seeds, JSON)
            if is_int(getattr(self, name)):
                setattr(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p"):
            if is_finite_number(getattr(self, name)) and not isinstance(getattr(self, name), int):
                setattr(self, name, float(getattr(self, name)))
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"an int in [1, {MAX_N}]")
        if not is_finite_number(self.temperature) or (
                self.temperature != 0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            bad("temperature", f"0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]")
        if not is_finite_number(self.top_p) or not MIN_TOP_P <= self.top_p <= 1:
            bad("top_p", f"in [{MIN_TOP_P:.3g}, 1] (float32's smallest normal number up to 1)")
        if not is_int(self.top_k) or self.top_k < -1 or self.top_k >= TOP_K_LIMIT:
            bad("top_k", "-1 or 0 (off) or an int in [1, 2**31)")
        self.top_k = -1 if self.top_k == 0 else self.top_k  # vLLM's and TRL's off; one value for it from here on
        if not is_finite_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an int >= 1")
        if self.seed is not None and not is_seed(self.seed):
            bad("seed", f"None or {SEED_RANGE}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            bad("logprobs_mode", f"one of {LOGPROBS_MODES}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # True/False: the sampled (or prompt) token's logprob, or none
                setattr(self, name, 0 if value else None)
            elif is_int(value) and 0 <= value <= MAX_LOGPROBS:
                setattr(self, name, int(value))
            elif value is not None:
                bad(name, f"None, a bool, or an int in [0, {MAX_LOGPROBS}] (the top-k alternatives to report)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            bad("stop", "None, a non-empty string, or a list of non-empty strings")
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "None, a non-empty string, or a list of non-empty strings")
        for i, s in enumerate(self.stop):  # a lone surrogate never appears in decoded text: it would never stop
            check_unicode(s, f"stop[{i}]")
        # every step checks every stop of every sequence, in a window four times the longest: unbounded, one
        # request would slow every other (100k stops: 100 s for a 1 s request)
        if len(self.stop) > MAX_STOPS or max(map(len, self.stop), default=0) > MAX_STOP_CHARS:
            bad("stop", f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            bad("stop_token_ids", "None or a list of token ids >= 0")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "None or a list of token ids >= 0")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]


    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p is on (then "processed" and "temperature" logprobs may differ)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


FIELDS = tuple(SamplingParams.__dataclass_fields__)


def _taking_vllm_fields(init):
    """The dataclass's __init__, taking vLLM's fields at their neutral values (NEUTRAL) and refusing an unknown
    keyword with the fields there are."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in [k for k in kwargs if k in NEUTRAL]:
            check_neutral(name, kwargs.pop(name), n=kwargs.get("n", 1))
        unknown = sorted(kwargs.keys() - set(FIELDS))
        if unknown:
            raise TypeError(f"SamplingParams got unknown argument(s) {unknown}; it takes {list(FIELDS)}")
        init(self, *args, **kwargs)
    return __init__


def _setattr(self, name: str, value) -> None:
    """A field, or a vLLM field at a neutral value (kept nowhere: it asks for nothing); anything else would be
    silently ignored by every step, so it is refused."""
    if name in NEUTRAL:
        return check_neutral(name, value, n=self.n)
    if name not in FIELDS:
        raise AttributeError(f"SamplingParams has no field {name!r}; it has {list(FIELDS)}")
    object.__setattr__(self, name, value)


SamplingParams.__init__ = _taking_vllm_fields(SamplingParams.__init__)
SamplingParams.__setattr__ = _setattr


def check_unicode(text: str, name: str) -> None:
    """Refuse a str that is not Unicode text: a lone surrogate ("\\ud800" is valid JSON and a valid Python str)
    cannot be encoded, so tokenizers fail on it and decoded text never contains it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} is not valid Unicode text ({err.reason} at character {err.start})") from None


def is_int(x) -> bool:
    """An int (numpy's integer scalars too), never a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_seed(x) -> bool:
    """A seed of the engine's or a request's: an int in [0, SEED_LIMIT)."""
    return is_int(x) and 0 <= x < SEED_LIMIT


def is_finite_number(x) -> bool:
    """A finite real number (numpy's scalars too), never a bool; an int too large for a float is not one (a JSON
    body's 400-digit number: math.isfinite raises OverflowError on it)."""
    try:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:
        return False


def processed_logprobs(logits, tokens, params: SamplingParams):
    """The logprobs the engine reports for `tokens` under `params` ("processed": after temperature, top-k, top-p
    and min-p, renormalised over the tokens kept), from `logits` [..., V] and `tokens` [...]; differentiable in
    `logits` (the filters' mask is not). A trainer scores its own logits with this to compare like with like: a
    full-vocabulary softmax differs from the engine's logprobs whenever a filter is on. Runs the sampling
    kernels' reference twin, so the filter is the engine's own definition."""
    params.validate()
    rows, vocab = tokens.numel(), logits.shape[-1]
    flat = logits.reshape(rows, vocab)

    def per_row(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device=flat.device)

    processed, _ = token_logprobs_ref(flat, tokens.reshape(rows), per_row(params.temperature, torch.float32),
                                      per_row(params.top_k, torch.int64), per_row(params.top_p, torch.float32),
                                      per_row(params.min_p, torch.float32))
    return processed.reshape(tokens.shape)