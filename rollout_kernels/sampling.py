"""Sampling, logprob gather and speculative rejection sampling.

Randomness comes from a counter-based hash of (seed, position, token), so the Triton
kernels and the torch references draw the same numbers, and a row's draw does not
depend on the rest of the batch."""
import torch
import triton
import triton.language as tl

from .launch import sm_count

_M = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


# ---------------------------------------------------------------- the shared noise (torch side)

def _mul32(x, c):
    """(x * c) mod 2**32 on int64 tensors; c is split in 16-bit halves so nothing overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M


def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def noise_key(seeds, positions):
    """Per-draw hash key (int64 tensor in [0, 2**32)) of a seed (all 64 bits) and a position.

    The seed's stream value `a` is one-to-one in its low 32 bits for fixed high ones. A position enters as
    mix(a ^ position), then `a` again: mix(a ^ position) alone would make the stream of a' = a ^ d the stream of
    a shifted to position ^ d, two samples sharing their noise wherever d is below their length."""
    a = _mix32(_mix32((seeds & _M) ^ _GOLDEN) ^ ((seeds >> 32) & _M))
    return _mix32((_mix32(a ^ (positions & _M)) + a) & _M)


# The noise spends all 32 hash bits where a draw is decided: near 0. u = (h + 1/2) 2**-32 resolves 2**-32 there
# (an acceptance test u < p/q with p/q small), and E = -log(1 - u) follows u to float32 precision below
# SERIES_BELOW through its series, where 1 - u would round: a token of probability p wins the race when its E is
# about p or less, so every p above about 2**-31 is drawn at its rate. u stops at the float below 1, so E is
# finite and a kept token's race score never falls to -inf.
BELOW_ONE = 1.0 - 2.0 ** -24
SERIES_BELOW = 2.0 ** -7


def uniform_of(h):
    """float32 u in [2**-33, BELOW_ONE] of hash values h (int64 tensor in [0, 2**32))."""
    return (h.float() * 2.0 ** -32 + 2.0 ** -33).clamp(max=BELOW_ONE)


def uniform_noise(key, token):
    """u(seed, position, token): uniform_of the hash; broadcasts key against token."""
    return uniform_of(_mix32((key + _mul32(token, _GOLDEN)) & _M))


def exponential_of(u):
    """-log(1 - u), an Exp(1) draw from a uniform one, accurate in float32 for u near 0 (E about u)."""
    series = u * (1.0 + u * (0.5 + u * (1.0 / 3.0 + u * (0.25 + u * 0.2))))  # truncation below u**6 / 6
    return torch.where(u < SERIES_BELOW, series, -torch.log(1.0 - u))


def exponential_noise(key, token):
    """E(seed, position, token): the race's Exp(1) noise; broadcasts key against token."""
    return exponential_of(uniform_noise(key, token))


# ---------------------------------------------------------------- references

def _filter_ref(logits, temperature, top_k, top_p, min_p, filters=None):
    """Temperature-scaled logits with the tokens dropped by top-k, top-p and min-p at -inf.

    Filters no row asks for are skipped: the sorts are most of the CPU engine's sampling time.
    `filters=False` promises no row asks for any (temperature only, no host synchronisation: what
    a CUDA graph can capture); None looks at the parameters."""
    s = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    vocab = s.shape[1]
    if filters is False:
        return s
    if ((top_k > 0) & (top_k < vocab)).any():
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
        kth = s.sort(dim=1, descending=True).values.gather(1, k[:, None] - 1)
        s = s.masked_fill(s < kth, float("-inf"))
    if not ((top_p < 1).any() or (min_p > 0).any()):
        return s
    p = s.softmax(dim=1)
    # "strictly likelier" is decided on the scaled logits, as the kernels decide it: logits a few ulps apart can
    # round to one float32 probability, and a tie there would keep a token the kernels drop
    ascending, order = s.sort(dim=1)
    above = p.gather(1, order).flip(1).cumsum(1).flip(1)  # above[m] = mass of the m-th smallest logit and up
    above = torch.cat([above, above.new_zeros(len(p), 1)], dim=1)
    greater = above.gather(1, torch.searchsorted(ascending, s, right=True))  # mass strictly above token i
    keep = (greater < top_p[:, None]) | (top_p[:, None] >= 1)
    keep &= p >= min_p[:, None] * p.max(dim=1, keepdim=True).values
    return s.masked_fill(~keep, float("-inf"))


def _logprobs_ref(s, logits, tokens):
    at = tokens[:, None]
    processed = s.log_softmax(dim=1).gather(1, at)[:, 0]
    raw = logits.float().log_softmax(dim=1).gather(1, at)[:, 0]
    return processed, raw


def mode_logprobs(logits, temperature, top_k, top_p, min_p, mode: str):
    """[B, V] float32 log-probabilities of each row's distribution under a logprobs mode: "raw" (the logits),
    "temperature" (logits / temperature, no truncation) or "processed" (also top-k, top-p and min-p, dropped
    tokens at -inf). Plain torch on any device: it serves only the rows that ask for top-k alternatives or
    prompt logprobs, which sample_* (one logprob per row) does not give."""
    if mode == "raw":
        return logits.float().log_softmax(dim=1)
    return _filter_ref(logits, temperature, top_k, top_p, min_p, False if mode == "temperature" else None).log_softmax(1)


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """Draw one token per row of logits [B, V]; returns (tokens, processed_logprob, raw_logprob).

    Temperature 0 is greedy on the raw logits. Otherwise the exponential race:
    argmax_i s_i - log(-log u_i) over the kept tokens samples exactly softmax(s)."""
    s = _filter_ref(logits, temperature, top_k, top_p, min_p)
    vocab = torch.arange(s.shape[1], device=s.device)
    noise = exponential_noise(noise_key(seeds, positions)[:, None], vocab)
    raced = (s - torch.log(noise)).argmax(dim=1)
    tokens = torch.where(temperature > 0, raced, logits.float().argmax(dim=1))
    return (tokens, *_logprobs_ref(s, logits, tokens))


def token_logprobs_ref(logits, tokens, temperature, top_k, top_p, min_p):
    """(processed, raw) logprobs of given tokens [B], as `sample` reports them (-inf if filtered)."""
    return _logprobs_ref(_filter_ref(logits, temperature, top_k, top_p, min_p), logits, tokens)


def rejection_sample_ref(draft_tokens, draft_probs, target_probs, seeds, positions):
    """Speculative verification of k draft tokens per row against the target's k+1 distributions.

    Returns out_tokens [B, k+1] (emitted tokens, then -1) and num_emitted [B] in 1..k+1."""
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[2]
    rows = torch.arange(batch, device=draft_tokens.device)
    keys = noise_key(seeds[:, None], positions[:, None] + torch.arange(k + 1, device=rows.device))
    p_t = target_probs[:, :k].gather(2, draft_tokens[..., None])[..., 0]
    q_t = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    accept = uniform_noise(keys[:, :k], vocab) < (p_t / q_t).clamp(max=1.0)
    n = accept.long().cumprod(dim=1).sum(dim=1)  # accepted before the first rejection
    p = target_probs[rows, n]
    residual = (p - draft_probs[rows, n.clamp(max=k - 1)]).clamp(min=0)
    use_residual = (n < k) & (residual.sum(dim=1) > 0)
    dist = torch.where(use_residual[:, None], residual, p)
    noise = exponential_noise(keys[rows, n][:, None], torch.arange(vocab, device=rows.device))
    last = (dist / noise).argmax(dim=1)  # exponential race over dist
    out = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    out = torch.where(torch.arange(k + 1, device=rows.device) < n[:, None], out, -1)
    out[rows, n] = last
    return out, n + 1


# ---------------------------------------------------------------- Triton
#
# Each row is cut into chunks scanned by (row, chunk) programs in parallel, whose partials one program
# per row merges (a row at batch 1 still fills the GPU); rows with top-k/top-p/min-p are scanned whole by
# one wide program each, in a launch of their own. A scan goes over tiles; running statistics stay per lane
# (vectors of the tile width) and are reduced once after the scan, not once per tile.

_INT_MIN, _INT_MAX = tl.constexpr(-2147483648), tl.constexpr(2147483647)
_BELOW_ONE, _SERIES_BELOW, _STEP = tl.constexpr(BELOW_ONE), tl.constexpr(SERIES_BELOW), tl.constexpr(2.0 ** -32)
_THIRD = tl.constexpr(1.0 / 3.0)


@triton.jit
def _mix32_tl(x):  # uint32: the multiplies wrap like the & _M above
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _noise_key_tl(seed, position):  # noise_key
    a = _mix32_tl(_mix32_tl(seed.to(tl.uint32) ^ 0x9E3779B9) ^ (seed >> 32).to(tl.uint32))
    return _mix32_tl(_mix32_tl(a ^ position.to(tl.uint32)) + a)


@triton.jit
def _uniform_tl(key, token):  # uniform_noise
    h = _mix32_tl(key + token.to(tl.uint32) * 0x9E3779B9)
    return tl.minimum(h.to(tl.float32) * _STEP + _STEP * 0.5, _BELOW_ONE)


@triton.jit
def _exponential_tl(key, token):  # exponential_noise
    u = _uniform_tl(key, token)
    series = u * (1.0 + u * (0.5 + u * (_THIRD + u * (0.25 + u * 0.2))))
    return tl.where(u < _SERIES_BELOW, series, -tl.log(1.0 - u))


@triton.jit
def _order_key(s):
    """int32 that orders like the float32 s (negative floats have their magnitude bits flipped); -0.0 and +0.0 are
    one key, as they compare equal (a threshold at +0.0 would otherwise drop the -0.0 tokens the reference keeps)."""
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_scaled(row_ptr, start, vocab, tdiv, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    ok = cols < vocab
    x = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
    return cols, ok, x, x / tdiv


@triton.jit
def _lane_lse(m, z, x):
    """Per-lane running max m and sum of exp(x - m)."""
    m_new = tl.maximum(m, x)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep z at 0, not nan
    return m_new, z * tl.exp(m - shift) + tl.exp(x - shift)


@triton.jit
def _reduce_lse(m, z):
    top = tl.max(m, 0)
    return top, tl.sum(z * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0)


@triton.jit
def _lane_argmax(best, best_i, score, cols):
    take = score > best  # strict: a lane keeps its earliest (lowest) index on ties
    return tl.where(take, score, best), tl.where(take, cols, best_i)


@triton.jit
def _reduce_argmax(best, best_i):
    return tl.min(tl.where(best == tl.max(best, 0), best_i, _INT_MAX), 0)


@triton.jit
def _kth_key(row_ptr, vocab, tdiv, k, max_key, BLOCK: tl.constexpr):
    """Order key of the k-th largest scaled logit, by bisection on the key.

    Each pass counts keys >= mid and snaps the bracket to the nearest keys present, so it
    ends once the k-th key is isolated (or exactly k keys are >= mid), well before 32 passes."""
    lo = tl.full([], _INT_MIN, tl.int64)
    hi = max_key.to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        count = tl.zeros([BLOCK], tl.int32)
        above = tl.full([BLOCK], _INT_MAX, tl.int32)
        below = tl.full([BLOCK], _INT_MIN, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols, ok, x, s = _load_scaled(row_ptr, start, vocab, tdiv, BLOCK)
            key = _order_key(s)
            hit = ok & (key >= mid.to(tl.int32))
            count += hit.to(tl.int32)
            above = tl.minimum(above, tl.where(hit, key, _INT_MAX))
            below = tl.maximum(below, tl.where(ok & ~hit, key, _INT_MIN))
        n = tl.sum(count, 0)
        lo = tl.where(n >= k, tl.min(above, 0).to(tl.int64), lo)
        hi = tl.where(n == k, lo, tl.where(n >= k, hi, tl.max(below, 0).to(tl.int64)))
    return lo.to(tl.int32)


@triton.jit
def _top_p_key(row_ptr, vocab, tdiv, m, kth, budget, BLOCK: tl.constexpr):
    """Smallest order key t (>= kth) whose kept mass strictly above t, sum exp(s - m), is < budget.

    Keeping s >= t is then exactly the top-p set. Bisection snapped to keys present, as above."""
    lo = kth.to(tl.int64)
    hi = _order_key(m).to(tl.int64)  # the top token: nothing above it
    while lo < hi:
        mid = (lo + hi) >> 1
        mass = tl.zeros([BLOCK], tl.float32)
        above = tl.full([BLOCK], _INT_MAX, tl.int32)
        below = tl.full([BLOCK], _INT_MIN, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols, ok, x, s = _load_scaled(row_ptr, start, vocab, tdiv, BLOCK)
            key = _order_key(s)
            candidate = ok & (key >= kth)
            up = candidate & (key > mid.to(tl.int32))
            mass += tl.where(up, tl.exp(s - m), 0.0)
            above = tl.minimum(above, tl.where(up, key, _INT_MAX))
            below = tl.maximum(below, tl.where(candidate & ~up, key, _INT_MIN))
        small = tl.sum(mass, 0) < budget
        hi = tl.where(small, tl.maximum(tl.max(below, 0).to(tl.int64), lo), hi)
        lo = tl.where(small, lo, tl.min(above, 0).to(tl.int64))
    return lo.to(tl.int32)


@triton.jit
def _sample_row(row, logits_ptr, stride_l, vocab, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,
                position_ptr, token_ptr, processed_ptr, raw_ptr, DRAW: tl.constexpr, BLOCK: tl.constexpr):
    """One whole truncated row: draw a token (DRAW) or take the given one, and report both logprobs.

    Top-k and top-p are found as thresholds on the scaled logits by bisection (no sort, no [V] scratch);
    one more pass keeps what passes every filter and races over it. The row's first pass takes only what
    the thresholds and a greedy row need; the race's noise is drawn once, and only for tiles holding a kept
    token."""
    logits = logits_ptr + row.to(tl.int64) * stride_l
    temperature = tl.load(temperature_ptr + row)
    tdiv = tl.where(temperature > 0, temperature, 1.0)
    top_k, top_p, min_p = tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), tl.load(min_p_ptr + row)
    use_k = (top_k > 0) & (top_k < vocab)
    if DRAW:
        key = _noise_key_tl(tl.load(seed_ptr + row), tl.load(position_ptr + row))

    m_x = tl.full([BLOCK], float("-inf"), tl.float32)
    z_x = tl.zeros([BLOCK], tl.float32)
    m_s = tl.full([BLOCK], float("-inf"), tl.float32)
    z_s = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols, ok, x, s = _load_scaled(logits, start, vocab, tdiv, BLOCK)
        m_x, z_x = _lane_lse(m_x, z_x, x)
        m_s, z_s = _lane_lse(m_s, z_s, s)
        if DRAW:  # the greedy token (a row with a temperature races below)
            best, best_i = _lane_argmax(best, best_i, tl.where(ok, x, float("-inf")), cols)
    m_x, z_x = _reduce_lse(m_x, z_x)
    m_s, z_all = _reduce_lse(m_s, z_s)
    if DRAW:
        token = _reduce_argmax(best, best_i)

    kth = tl.full([], _INT_MIN, tl.int32)
    top = tl.full([], _INT_MIN, tl.int32)
    if use_k:
        kth = _kth_key(logits, vocab, tdiv, top_k, _order_key(m_s), BLOCK)
    if top_p < 1.0:
        total = z_all  # without top-k every token is a candidate: the first pass's sum
        if use_k:
            mass = tl.zeros([BLOCK], tl.float32)
            for start in range(0, vocab, BLOCK):
                cols, ok, x, s = _load_scaled(logits, start, vocab, tdiv, BLOCK)
                mass += tl.where(ok & (_order_key(s) >= kth), tl.exp(s - m_s), 0.0)
            total = tl.sum(mass, 0)
        top = _top_p_key(logits, vocab, tdiv, m_s, kth, top_p * total, BLOCK)
    kept_z = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols, ok, x, s = _load_scaled(logits, start, vocab, tdiv, BLOCK)
        e = tl.exp(s - m_s)
        key_s = _order_key(s)
        keep = ok & (key_s >= kth) & (key_s >= top) & (e >= min_p)
        kept_z += tl.where(keep, e, 0.0)
        if DRAW:
            if (temperature > 0) & (tl.max(keep.to(tl.int32), 0) > 0):
                score = tl.where(keep, s - tl.log(_exponential_tl(key, cols)), float("-inf"))
                best, best_i = _lane_argmax(best, best_i, score, cols)
    z = tl.sum(kept_z, 0)
    if DRAW:
        token = tl.where(temperature > 0, _reduce_argmax(best, best_i), token)
        tl.store(token_ptr + row, token.to(tl.int64))
    else:
        token = tl.load(token_ptr + row)
    x_t = tl.load(logits + token).to(tl.float32)
    s_t = x_t / tdiv
    key_t = _order_key(s_t)
    kept = (key_t >= kth) & (key_t >= top) & (tl.exp(s_t - m_s) >= min_p)
    tl.store(processed_ptr + row, tl.where(kept, s_t - m_s - tl.log(z), float("-inf")))
    tl.store(raw_ptr + row, x_t - m_x - tl.log(z_x))


@triton.jit
def _truncated(row, vocab, top_k_ptr, top_p_ptr, min_p_ptr):
    top_k = tl.load(top_k_ptr + row)
    return ((top_k > 0) & (top_k < vocab)) | (tl.load(top_p_ptr + row) < 1.0) | (tl.load(min_p_ptr + row) > 0.0)


@triton.jit
def _sample_split_kernel(logits_ptr, stride_l, vocab, chunk, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                         seed_ptr, position_ptr, token_ptr, processed_ptr, raw_ptr, part_ptr,
                         DRAW: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split). An untruncated row is cut into SPLITS chunks scanned in parallel, each
    leaving its partial (max, sum-exp) of raw and scaled logits and its best score (the race when
    DRAW and the row has a temperature, else the raw logit) for the merge; truncated rows are left
    to _sample_truncated_kernel."""
    row, split = tl.program_id(0), tl.program_id(1)
    if not _truncated(row, vocab, top_k_ptr, top_p_ptr, min_p_ptr):
        logits = logits_ptr + row.to(tl.int64) * stride_l
        temperature = tl.load(temperature_ptr + row)
        tdiv = tl.where(temperature > 0, temperature, 1.0)
        if DRAW:
            key = _noise_key_tl(tl.load(seed_ptr + row), tl.load(position_ptr + row))
        lo = split * chunk
        hi = tl.minimum(lo + chunk, vocab)
        m_x = tl.full([BLOCK], float("-inf"), tl.float32)
        z_x = tl.zeros([BLOCK], tl.float32)
        m_s = tl.full([BLOCK], float("-inf"), tl.float32)
        z_s = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for start in range(lo, hi, BLOCK):
            cols, ok, x, s = _load_scaled(logits, start, hi, tdiv, BLOCK)
            m_x, z_x = _lane_lse(m_x, z_x, x)
            m_s, z_s = _lane_lse(m_s, z_s, s)
            score = x
            if DRAW:
                score = tl.where(temperature > 0, s - tl.log(_exponential_tl(key, cols)), x)
            best, best_i = _lane_argmax(best, best_i, tl.where(ok, score, float("-inf")), cols)
        m_x, z_x = _reduce_lse(m_x, z_x)
        m_s, z_s = _reduce_lse(m_s, z_s)
        top = tl.max(best, 0)
        part = part_ptr + (row.to(tl.int64) * SPLITS + split) * 6
        tl.store(part + 0, m_x)
        tl.store(part + 1, z_x)
        tl.store(part + 2, m_s)
        tl.store(part + 3, z_s)
        tl.store(part + 4, top)
        tl.store(part + 5, _reduce_argmax(best, best_i).to(tl.float32))  # < 2**24: exact


@triton.jit
def _sample_truncated_kernel(logits_ptr, stride_l, vocab, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                             seed_ptr, position_ptr, token_ptr, processed_ptr, raw_ptr, DRAW: tl.constexpr,
                             BLOCK: tl.constexpr):
    """Program (row): a truncated row whole (its thresholds need the whole row); other rows return at once.
    A launch of its own, so the row's many serial passes get more warps than the split scan's programs."""
    row = tl.program_id(0)
    if _truncated(row, vocab, top_k_ptr, top_p_ptr, min_p_ptr):
        _sample_row(row, logits_ptr, stride_l, vocab, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                    seed_ptr, position_ptr, token_ptr, processed_ptr, raw_ptr, DRAW=DRAW, BLOCK=BLOCK)


@triton.jit
def _merge_parts(row, part_ptr, SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr):
    """A row's whole-row (m_x, z_x, m_s, z_s, best index) from its splits' partials."""
    sp = tl.arange(0, SPLITS_POW2)
    ok = sp < SPLITS
    part = part_ptr + (row.to(tl.int64) * SPLITS + sp) * 6
    m_x, z_x = _reduce_lse(tl.load(part + 0, mask=ok, other=float("-inf")), tl.load(part + 1, mask=ok, other=0.0))
    m_s, z_s = _reduce_lse(tl.load(part + 2, mask=ok, other=float("-inf")), tl.load(part + 3, mask=ok, other=0.0))
    best = tl.load(part + 4, mask=ok, other=float("-inf"))
    index = tl.load(part + 5, mask=ok, other=0.0).to(tl.int32)
    return m_x, z_x, m_s, z_s, _reduce_argmax(best, index)  # ties: the lowest index, as one whole-row scan


@triton.jit
def _sample_merge_kernel(logits_ptr, stride_l, vocab, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                         token_ptr, processed_ptr, raw_ptr, part_ptr, DRAW: tl.constexpr, SPLITS: tl.constexpr,
                         SPLITS_POW2: tl.constexpr):
    """Per untruncated row: the drawn token (DRAW) or the given one, and its two logprobs."""
    row = tl.program_id(0)
    if not _truncated(row, vocab, top_k_ptr, top_p_ptr, min_p_ptr):
        m_x, z_x, m_s, z_s, token = _merge_parts(row, part_ptr, SPLITS, SPLITS_POW2)
        if DRAW:
            tl.store(token_ptr + row, token.to(tl.int64))
        else:
            token = tl.load(token_ptr + row)
        x_t = tl.load(logits_ptr + row.to(tl.int64) * stride_l + token).to(tl.float32)
        temperature = tl.load(temperature_ptr + row)
        s_t = x_t / tl.where(temperature > 0, temperature, 1.0)
        tl.store(processed_ptr + row, s_t - m_s - tl.log(z_s))
        tl.store(raw_ptr + row, x_t - m_x - tl.log(z_x))


@triton.jit
def _probs_kernel(logits_ptr, stride_l, vocab, chunk, temperature_ptr, part_ptr, probs_ptr,
                  SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split): its chunk of softmax(x / temperature), or of the one-hot raw argmax (greedy)."""
    row, split = tl.program_id(0), tl.program_id(1)
    _, _, m_s, z_s, top = _merge_parts(row, part_ptr, SPLITS, SPLITS_POW2)
    temperature = tl.load(temperature_ptr + row)
    tdiv = tl.where(temperature > 0, temperature, 1.0)
    logits = logits_ptr + row.to(tl.int64) * stride_l
    out = probs_ptr + row.to(tl.int64) * vocab
    hi = tl.minimum(split * chunk + chunk, vocab)
    for start in range(split * chunk, hi, BLOCK):
        cols, ok, x, s = _load_scaled(logits, start, hi, tdiv, BLOCK)
        p = tl.where(temperature > 0, tl.exp(s - m_s) / z_s, tl.where(cols == top, 1.0, 0.0))
        tl.store(out + cols, p, mask=ok)


# Batch-invariant mode's vocabulary splits (rollout_kernels.get_ops(..., batch_invariant=True)): the chunks, and so
# the tree that merges a row's (max, sum-exp) partials, are then a function of the vocabulary alone (Qwen3's
# 151936: 30 chunks of 5 blocks of 1024), and a batch-1 decode still runs about 32 programs per row.
FIXED_VOCAB_SPLITS = 32


# A truncated row's program: its tile and warps. Its bisection passes each read the whole row in sequence,
# so the program's throughput (not the number of programs) bounds the row.
TRUNCATED_BLOCK, TRUNCATED_WARPS = 8192, 32


def _split_rows(batch: int, vocab: int, device, splits: int | None = None) -> tuple[int, int, int]:
    """(block, chunk, splits): each row cut into chunks of whole blocks, enough programs to fill the GPU
    at small batch (host values only, so a CUDA graph replays the same grid). Given `splits`, the chunks
    depend on (vocab, splits) only: a row's bits do not depend on the batch."""
    block = min(1024, triton.next_power_of_2(triton.cdiv(vocab, 4)))
    if splits is None:
        splits = max(1, min(triton.cdiv(vocab, block), triton.cdiv(2 * sm_count(device), max(batch, 1))))
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    return block, chunk, triton.cdiv(vocab, chunk)


def _check_rows(**per_row) -> None:
    """The kernels index per-row tensors by row, without strides: a strided view (a one-row expand is
    stride 0) would read its neighbours' values."""
    for name, t in per_row.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernels index it by row), got strides {t.stride()}")


def _launch_rows(logits, temperature, top_k, top_p, min_p, seeds, positions, tokens, splits=None, merge=True):
    """The split scan (and the merge) over rows of logits. `tokens` None: draw them; else the given tokens'
    logprobs. Returns (tokens, processed, raw, partials, (block, chunk, splits)); merge=False leaves the
    untruncated rows' logprobs unset (the partials are all a caller of _probs_kernel needs)."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1
    _check_rows(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, positions=positions,
                tokens=tokens)
    draw = tokens is None
    if draw:
        tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
        seeds_or_any, positions_or_any = seeds, positions
    else:
        seeds_or_any = positions_or_any = tokens  # not read without DRAW
    processed = torch.empty(batch, dtype=torch.float32, device=logits.device)
    raw = torch.empty_like(processed)
    block, chunk, splits = _split_rows(batch, vocab, logits.device, splits)
    part = torch.empty(batch * splits * 6, dtype=torch.float32, device=logits.device)
    if batch:
        _sample_split_kernel[(batch, splits)](logits, logits.stride(0), vocab, chunk, temperature, top_k, top_p,
                                              min_p, seeds_or_any, positions_or_any, tokens, processed, raw, part,
                                              DRAW=draw, SPLITS=splits, BLOCK=block, num_warps=4)
        if merge:
            _sample_truncated_kernel[(batch,)](logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p,
                                               seeds_or_any, positions_or_any, tokens, processed, raw, DRAW=draw,
                                               BLOCK=TRUNCATED_BLOCK, num_warps=TRUNCATED_WARPS)
            _sample_merge_kernel[(batch,)](logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p, tokens,
                                           processed, raw, part, DRAW=draw, SPLITS=splits,
                                           SPLITS_POW2=triton.next_power_of_2(splits), num_warps=1)
    return tokens, processed, raw, part, (block, chunk, splits)


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds, positions, splits=None):
    """Triton twin of sample_ref: untruncated rows split across programs (`splits` per row; None: by the
    batch), truncated rows one program each."""
    return _launch_rows(logits, temperature, top_k, top_p, min_p, seeds, positions, None, splits)[:3]


def token_logprobs_triton(logits, tokens, temperature, top_k, top_p, min_p, splits=None):
    """Triton twin of token_logprobs_ref: the sampling scan with the tokens given (the same splits give the
    same bits as sample_triton's logprobs of those tokens)."""
    return _launch_rows(logits, temperature, top_k, top_p, min_p, None, None, tokens, splits)[1:3]


def processed_probs_ref(logits, temperature, top_k, top_p, min_p, filters=None):
    """[B, V] float32: the distribution `sample` draws each row from (one-hot at the raw argmax for
    greedy rows). `filters`: as in _filter_ref."""
    probs = _filter_ref(logits, temperature, top_k, top_p, min_p, filters).softmax(dim=1)
    greedy = torch.zeros_like(probs).scatter_(1, logits.float().argmax(dim=1, keepdim=True), 1.0)
    return torch.where((temperature > 0)[:, None], probs, greedy)


def _truncated_rows(vocab, top_k, top_p, min_p):
    """Host twin of `_truncated`: the rows with top-k, top-p or min-p."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)


def processed_probs_triton(logits, temperature, top_k, top_p, min_p, filters=None, splits=None):
    """Triton twin of processed_probs_ref for rows without top-k/top-p/min-p (what graphs capture, promised
    by filters=False): the split scan's partials, then each chunk written in parallel. Rows with filters
    take the reference (their thresholds need sorts; only eager steps have them)."""
    if filters is not False and bool(_truncated_rows(logits.shape[1], top_k, top_p, min_p).any()):
        return processed_probs_ref(logits, temperature, top_k, top_p, min_p, filters)
    batch, vocab = logits.shape
    probs = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
    if batch:
        *_, part, (block, chunk, splits) = _launch_rows(logits, temperature, top_k, top_p, min_p, None, None,
                                                        probs.new_zeros(batch, dtype=torch.int64), splits,
                                                        merge=False)
        _probs_kernel[(batch, splits)](logits, logits.stride(0), vocab, chunk, temperature, part, probs,
                                       SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits), BLOCK=block,
                                       num_warps=4)
    return probs


@triton.jit
def _accepted(row, draft_ptr, q_ptr, p_ptr, seed, position, vocab, K: tl.constexpr):
    """Draft tokens accepted before the first rejection."""
    n = tl.zeros([], tl.int64)
    for j in tl.static_range(K):
        t = tl.load(draft_ptr + row * K + j)
        p_t = tl.load(p_ptr + (row * (K + 1) + j) * vocab + t)
        q_t = tl.load(q_ptr + (row * K + j) * vocab + t)
        u = _uniform_tl(_noise_key_tl(seed, position + j), vocab)
        n = tl.where((n == j) & (u < p_t / q_t), n + 1, n)  # u < 1, so u < p/q is u < min(1, p/q)
    return n


@triton.jit
def _rejection_split_kernel(draft_ptr, q_ptr, p_ptr, seed_ptr, position_ptr, part_ptr, vocab, chunk,
                            K: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split): over its chunk, the exponential races over max(0, p - q) and over p at the
    first rejected position (or the bonus one), and the residual's mass, for the merge."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    seed, position = tl.load(seed_ptr + row), tl.load(position_ptr + row)
    n = _accepted(row, draft_ptr, q_ptr, p_ptr, seed, position, vocab, K)
    key = _noise_key_tl(seed, position + n)
    p_row = p_ptr + (row * (K + 1) + n) * vocab
    q_row = q_ptr + (row * K + tl.minimum(n, K - 1)) * vocab
    best_r = tl.full([BLOCK], -1.0, tl.float32)
    best_p = tl.full([BLOCK], -1.0, tl.float32)
    index_r = tl.zeros([BLOCK], tl.int32)
    index_p = tl.zeros([BLOCK], tl.int32)
    residual_mass = tl.zeros([BLOCK], tl.float32)
    hi = tl.minimum(split * chunk + chunk, vocab)
    for start in range(split * chunk, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hi
        p = tl.load(p_row + cols, mask=ok, other=0.0)
        residual = tl.maximum(p - tl.load(q_row + cols, mask=ok, other=0.0), 0.0)
        e = _exponential_tl(key, cols)
        residual_mass += residual
        best_r, index_r = _lane_argmax(best_r, index_r, tl.where(ok, residual / e, -1.0), cols)
        best_p, index_p = _lane_argmax(best_p, index_p, tl.where(ok, p / e, -1.0), cols)
    part = part_ptr + (row * SPLITS + split) * 5
    tl.store(part + 0, tl.max(best_r, 0))
    tl.store(part + 1, _reduce_argmax(best_r, index_r).to(tl.float32))  # < 2**24: exact
    tl.store(part + 2, tl.max(best_p, 0))
    tl.store(part + 3, _reduce_argmax(best_p, index_p).to(tl.float32))
    tl.store(part + 4, tl.sum(residual_mass, 0))


@triton.jit
def _rejection_merge_kernel(draft_ptr, q_ptr, p_ptr, seed_ptr, position_ptr, part_ptr, out_ptr, num_ptr, vocab,
                            K: tl.constexpr, OUT_POW2: tl.constexpr, SPLITS: tl.constexpr,
                            SPLITS_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = _accepted(row, draft_ptr, q_ptr, p_ptr, tl.load(seed_ptr + row), tl.load(position_ptr + row), vocab, K)
    sp = tl.arange(0, SPLITS_POW2)
    ok = sp < SPLITS
    part = part_ptr + (row * SPLITS + sp) * 5
    index_r = tl.load(part + 1, mask=ok, other=0.0).to(tl.int32)
    index_p = tl.load(part + 3, mask=ok, other=0.0).to(tl.int32)
    last_r = _reduce_argmax(tl.load(part + 0, mask=ok, other=-2.0), index_r)
    last_p = _reduce_argmax(tl.load(part + 2, mask=ok, other=-2.0), index_p)
    use_residual = (n < K) & (tl.sum(tl.load(part + 4, mask=ok, other=0.0), 0) > 0)
    last = tl.where(use_residual, last_r, last_p)
    idx = tl.arange(0, OUT_POW2)
    drafts = tl.load(draft_ptr + row * K + idx, mask=idx < n, other=-1)
    tl.store(out_ptr + row * (K + 1) + idx, tl.where(idx == n, last.to(tl.int64), drafts), mask=idx <= K)
    tl.store(num_ptr + row, n + 1)


def rejection_sample_triton(draft_tokens, draft_probs, target_probs, seeds, positions, splits=None):
    """Triton twin of rejection_sample_ref (contiguous inputs): each row's races split across programs
    like sampling's, then merged per row."""
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[2]
    _check_rows(draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=target_probs, seeds=seeds,
                positions=positions)
    out = torch.empty((batch, k + 1), dtype=torch.int64, device=draft_tokens.device)
    num = torch.empty(batch, dtype=torch.int64, device=draft_tokens.device)
    block, chunk, splits = _split_rows(batch, vocab, draft_tokens.device, splits)
    part = torch.empty(batch * splits * 5, dtype=torch.float32, device=draft_tokens.device)
    if batch:
        _rejection_split_kernel[(batch, splits)](draft_tokens, draft_probs, target_probs, seeds, positions, part,
                                                 vocab, chunk, K=k, SPLITS=splits, BLOCK=block, num_warps=4)
        _rejection_merge_kernel[(batch,)](draft_tokens, draft_probs, target_probs, seeds, positions, part, out, num,
                                          vocab, K=k, OUT_POW2=triton.next_power_of_2(k + 1), SPLITS=splits,
                                          SPLITS_POW2=triton.next_power_of_2(splits), num_warps=1)
    return out, num
