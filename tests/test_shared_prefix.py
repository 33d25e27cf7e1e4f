"""Decode attention that reads a prompt shared by a group of sequences once a group (rollout_kernels/shared_prefix.py,
rollout_engine/prefix_groups.py): the groups found in block tables, the kernels against the reference, and an
engine whose n samples of a prompt attend it as a group."""
import numpy as np
import pytest
import torch

from rollout_kernels import attention
from rollout_kernels import shared_prefix as sp

from rollout_engine import Engine, SamplingParams, prefix_groups
from rollout_engine.step_buffers import StepBuffers
from helpers import agreeing_runs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_groups_are_rows_whose_tables_start_with_the_same_blocks():
    # rows 0, 2, 4 share blocks 7, 8 (row 4's third block too, but not row 0's); row 1 shares block 9 with row 5
    # for its first block only and row 5 is too short to hold a whole shared block; row 3 is alone
    tables = np.array([[7, 8, 20, 0], [9, 21, 0, 0], [7, 8, 22, 23], [30, 31, 0, 0], [7, 8, 20, 24], [9, 25, 0, 0]])
    lens = np.array([40, 20, 60, 30, 50, 4])
    groups, keys, first_key = sp.plan_shared_prefixes(tables, lens, 16, members=8)
    assert groups.tolist() == [[0, 2, 4, -1, -1, -1, -1, -1]] and keys.tolist() == [32]
    assert first_key.tolist() == [32, 0, 32, 0, 32, 0]
    # two members at most: rows 0 and 2 share 32 keys; row 4 alone in its chunk shares nothing
    groups, keys, first_key = sp.plan_shared_prefixes(tables, lens, 16, members=2)
    assert groups.tolist() == [[0, 2]] and keys.tolist() == [32] and first_key.tolist() == [32, 0, 32, 0, 0, 0]
    # a member's newest key is its own: rows 0 and 4 share blocks 7, 8, 20, but row 0 holds 40 keys, so 32
    groups, keys, _ = sp.plan_shared_prefixes(tables[[0, 4]], np.array([40, 50]), 16, members=8)
    assert keys.tolist() == [32]
    groups, keys, _ = sp.plan_shared_prefixes(tables[[0, 4]], np.array([49, 50]), 16, members=8)
    assert keys.tolist() == [48]


@pytest.mark.parametrize("heads_per_kv, members", [(1, 8), (2, 8), (4, 4), (8, 2), (16, 0)])
def test_a_group_fills_one_tile_of_query_rows(heads_per_kv, members):
    assert sp.members_per_group(heads_per_kv) == members


def grouped_batch(fp8, dtype=torch.float32, device=DEV, heads=4, kv_heads=2, head_dim=32, block_size=4):
    """Seven decoding sequences: three share 3 prompt blocks, three share 2, one shares nothing."""
    g = torch.Generator().manual_seed(3)
    lens, tables, blocks = [15, 14, 13, 11, 10, 9, 7], [], 5
    for s, n in enumerate(lens):
        table = [0, 1, 2] if s < 3 else [3, 4] if s < 6 else []
        while len(table) * block_size < n:
            table.append(blocks)
            blocks += 1
        tables.append(table + [0] * (6 - len(table)))
    k, v = (torch.randn(blocks, block_size, kv_heads, head_dim, generator=g) * 2 for _ in range(2))
    scales = {}
    if fp8:
        ks, vs = k.abs().amax(-1) / 448, v.abs().amax(-1) / 448
        k, v = (k / ks[..., None]).to(torch.float8_e4m3fn), (v / vs[..., None]).to(torch.float8_e4m3fn)
        scales = {"k_scale": ks.to(device), "v_scale": vs.to(device)}
    return dict(q=torch.randn(len(lens), heads, head_dim, generator=g).to(device, dtype), k_cache=k.to(device),
                v_cache=v.to(device), block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=device), max_query_len=1,
                scale=head_dim ** -0.5, **scales)


def shared_of(args, members):
    groups, keys, first_key = sp.plan_shared_prefixes(args["block_tables"].cpu().numpy(),
                                                      args["seq_lens"].cpu().numpy(), args["k_cache"].shape[1],
                                                      members)
    return sp.SharedPrefix(*(torch.from_numpy(x).to(args["q"].device) for x in (groups, keys, first_key)))


def padded(shared, groups):
    """`shared` as a step's buffers hold it: `groups` rows, those past its groups unused (no member, 0 keys)."""
    members = torch.full((groups, shared.members.shape[1]), -1, dtype=torch.int32, device=shared.members.device)
    keys = torch.zeros(groups, dtype=torch.int32, device=shared.keys.device)
    members[: shared.keys.numel()], keys[: shared.keys.numel()] = shared.members, shared.keys
    return sp.SharedPrefix(members, keys, shared.first_key)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("members, splits, groups", [(2, 1, None), (4, 1, None), (4, 3, None), (4, 2, 3)])
def test_shared_prefix_attention_matches_the_reference(monkeypatch, fp8, members, splits, groups):
    """Every row, grouped or not, whatever the split of its own keys: the prefix is one more partial; unused
    groups (a step's buffers hold seqs // 2) change nothing."""
    monkeypatch.setattr(attention, "_num_splits", lambda *_: splits)
    args = grouped_batch(fp8)
    shared = shared_of(args, members)
    assert shared.keys.tolist() == [12, 8] and shared.first_key.tolist() == ([12, 12, 0, 8, 8, 0, 0] if members == 2
                                                                             else [12, 12, 12, 8, 8, 8, 0])
    if groups:
        shared = padded(shared, groups)
    torch.testing.assert_close(attention.paged_attention_triton(**args, shared=shared),
                               attention.paged_attention_ref(**args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix_splits", [1, 2, 3])
def test_a_long_prefix_split_across_programs_matches_the_reference(monkeypatch, prefix_splits):
    """Prefixes of 160 and 96 keys (3 and 2 key tiles of 64) cut into up to 3 partials, one of them empty."""
    monkeypatch.setattr(sp, "prefix_splits", lambda *_: prefix_splits)
    g = torch.Generator().manual_seed(4)
    lens, kv_heads, head_dim, bs = [180, 170, 175, 120, 100, 40], 2, 32, 16
    tables, blocks = [], 16
    for s_, n in enumerate(lens):
        table = list(range(10)) if s_ < 3 else list(range(10, 16)) if s_ < 5 else []
        while len(table) * bs < n:
            table.append(blocks)
            blocks += 1
        tables.append(table + [0] * (12 - len(table)))
    k, v = (torch.randn(blocks, bs, kv_heads, head_dim, generator=g) for _ in range(2))
    args = dict(q=torch.randn(len(lens), 4, head_dim, generator=g), k_cache=k, v_cache=v,
                block_tables=torch.tensor(tables, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
                query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32), max_query_len=1, scale=head_dim ** -0.5)
    shared = shared_of(args, 4)
    assert shared.keys.tolist() == [160, 96]
    torch.testing.assert_close(attention.paged_attention_triton(**args, shared=shared),
                               attention.paged_attention_ref(**args), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_shared_prefix_attention_matches_plain_decode_compiled(fp8):
    """bf16 queries, compiled: the same rows as plain decode attention, up to the order of the sums. Outputs reach
    6.5 here, where one bf16 step is 2**-5: grouped rows may differ from plain ones by that rounding, and are no
    further from the reference (float32 sums) than plain decode attention is, give or take one such step."""
    args = grouped_batch(fp8, dtype=torch.bfloat16, heads=16, kv_heads=8, head_dim=128, block_size=4)
    ref, plain = attention.paged_attention_ref(**args).float(), attention.paged_attention_triton(**args).float()
    step = 2.0 ** (torch.floor(torch.log2(ref.abs().max())) - 7).item()
    for members in (2, 4, 8):
        got = attention.paged_attention_triton(**args, shared=shared_of(args, members)).float()
        torch.testing.assert_close(got, plain, atol=step, rtol=0)
        assert (got - ref).abs().max() <= (plain - ref).abs().max() + step


def run_samples(engine, prompts, n, max_tokens=6):
    params = SamplingParams(n=n, temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True)
    return [(c.token_ids, c.logprobs) for o in engine.generate(prompts, params, use_tqdm=False) for c in o.outputs]


@pytest.mark.parametrize("prompt, own, size, grouped", [(48, 64, 16, False), (96, 16, 16, True),
                                                          (48, 64, 128, True), (16, 96, 128, False)])
def test_a_step_takes_the_groups_only_when_their_repeats_are_worth_it(prompt, own, size, grouped):
    """2 prompts x 8 samples: the repeats of a prompt are 3/8 of the step's keys at (48, 64), three quarters at
    (96, 16), an eighth at (16, 96); a step of 16-127 rows needs half (prefix_groups.MIN_SAVED), 128 rows a quarter."""
    buffers = StepBuffers(max_tokens=128, max_rows=128, max_blocks=16, device=torch.device("cpu"))
    host, bs, fresh = buffers.host, 16, 200
    for row in range(16):
        table = list(range(row // 8 * 50, row // 8 * 50 + prompt // bs))
        table += list(range(fresh, fresh + own // bs))
        fresh += own // bs
        host["block_tables"][row, : len(table)] = table
        host["seq_lens"][row] = prompt + own
    groups = prefix_groups.PrefixGroups(query_heads_per_kv=2, block_size=bs, buffers=buffers)
    assert groups.write(16, size) is grouped
    assert host["prefix_keys"][:2].tolist() == ([prompt, prompt] if grouped else [0, 0])


def test_the_samples_of_a_prompt_attend_it_as_a_group(tiny_checkpoint, monkeypatch):
    """Two 40-token prompts x 8 samples: decode steps pass attention each prompt's two whole blocks as one
    group's prefix; with the groups switched off the same samples come out."""
    seen = []
    reference = attention.paged_attention_ref

    def recording(*args, shared=None, **kwargs):
        if shared is not None:
            seen.append((shared.members.clone(), shared.keys.clone(), shared.first_key.clone()))
        return reference(*args, **kwargs)

    monkeypatch.setattr(attention, "paged_attention_ref", recording)
    monkeypatch.setattr(prefix_groups, "MIN_SAVED", {16: 0.25})
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=64 << 20, max_num_seqs=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (40,), generator=g).tolist() for _ in range(2)]
    grouped = run_samples(engine, prompts, 8)
    assert seen, "no decode step took the groups"
    members, keys, first_key = seen[-1]
    assert sorted(keys.tolist(), reverse=True)[:2] == [32, 32] and (first_key == 32).all()
    rows = [[r for r in row.tolist() if r >= 0] for row in members[keys > 0]]
    assert sorted(map(len, rows)) == [8, 8] and sorted(sum(rows, [])) == list(range(16))
    monkeypatch.setattr(prefix_groups, "ENABLED", False)
    seen.clear()
    assert run_samples(engine, prompts, 8) == grouped and not seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8"])
def test_grouped_samples_on_gpu_match_plain_decode(tiny_checkpoint, monkeypatch, kv_cache_dtype):
    """CUDA graphs of both kinds in one engine: 4 prompts x 8 samples through the groups' graphs, then with the
    groups off; bf16 changes only the order of attention's sums, so the samples agree but at near-ties."""
    monkeypatch.setattr(prefix_groups, "MIN_SAVED", {16: 0.25})
    engine = Engine(tiny_checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=256 << 20, max_num_seqs=32,
                    kv_cache_dtype=kv_cache_dtype)
    taken, write = [], engine.runner.prefix_groups.write
    monkeypatch.setattr(engine.runner.prefix_groups, "write", lambda *a: taken.append(write(*a)) or taken[-1])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 200, (40,), generator=g).tolist() for _ in range(4)]
    grouped = run_samples(engine, prompts, 8, max_tokens=24)
    assert sum(taken) >= 20, "the decode steps did not take the groups"
    monkeypatch.setattr(prefix_groups, "ENABLED", False)
    plain = run_samples(engine, prompts, 8, max_tokens=24)
    assert agreeing_runs(grouped, plain) >= 28
