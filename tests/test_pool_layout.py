"""pool_layout: sizing equals allocation, views land in their own bytes, rows come from one walk."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pool_layout import EntryField, LayerArena, MhaKvPool, PoolPlanner, PoolRows, aligned_empty, carve, plan_regions

KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]

geometry = st.fixed_dictionaries({
    "layers": st.integers(1, 4),
    "block_size": st.sampled_from([1, 3, 8, 16]),
    "num_kv_heads": st.integers(1, 4),
    "head_dim": st.sampled_from([8, 24, 64]),
    "kv_dtype": st.sampled_from(KV_DTYPES),
})


def byte_span(view: torch.Tensor, buf: torch.Tensor) -> tuple[int, int]:
    start = view.data_ptr() - buf.data_ptr()
    return start, start + view.numel() * view.element_size()


@settings(max_examples=60, deadline=None)
@given(geometry, st.integers(1, 9))
def test_pool_bytes_is_exactly_what_allocation_uses(geo, blocks):
    pool = MhaKvPool(**geo)
    need = pool.pool_bytes(blocks)
    buf = aligned_empty(need)
    pool.allocate(blocks, buf=buf)  # exactly `need` bytes suffice ...
    spans = []
    for row in range(geo["layers"]):
        views = list(pool.kv_views(row)) + list(pool.scale_views(row) or [])
        spans += [byte_span(v, buf) for v in views]
    assert all(0 <= a < b <= need for a, b in spans)
    spans.sort()
    assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:])), "two views share bytes"
    with pytest.raises(ValueError, match="bytes"):
        MhaKvPool(**geo).allocate(blocks, buf=aligned_empty(need - 1))  # ... and one byte less does not


@settings(max_examples=60, deadline=None)
@given(geometry, geometry, st.integers(1, 1 << 22))
def test_budget_to_blocks_fits_and_is_maximal(target_geo, draft_geo, budget):
    planner = PoolPlanner({"target": MhaKvPool(**target_geo), "draft": MhaKvPool(**draft_geo)})
    if planner.total_bytes(1) > budget:
        with pytest.raises(ValueError, match="holds no block"):
            planner.blocks_for_budget(budget)
        return
    blocks = planner.blocks_for_budget(budget)
    assert planner.total_bytes(blocks) <= budget < planner.total_bytes(blocks + 1)
    planner.allocate(blocks, buf=aligned_empty(budget))  # the budget itself is enough to carve


def test_block_price_counts_every_field():
    bf16 = MhaKvPool(layers=3, block_size=16, num_kv_heads=2, head_dim=64, kv_dtype="bfloat16")
    fp8 = MhaKvPool(layers=3, block_size=16, num_kv_heads=2, head_dim=64, kv_dtype="float8_e4m3fn")
    assert bf16.entry_bytes == 3 * 2 * (16 * 2 * 64 * 2)
    assert fp8.entry_bytes == 3 * 2 * (16 * 2 * 64 * 1) + 3 * 2 * (16 * 2 * 4)  # + per-(token, head) fp32 scales
    planner = PoolPlanner({"target": bf16, "draft": fp8})
    assert planner.block_bytes == bf16.entry_bytes + fp8.entry_bytes


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_write_through_a_view_lands_in_exactly_its_bytes(kv_dtype):
    target = MhaKvPool(layers=3, block_size=4, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype)
    draft = MhaKvPool(layers=2, block_size=4, num_kv_heads=1, head_dim=8, kv_dtype=torch.float32)
    planner = PoolPlanner({"target": target, "draft": draft})
    blocks = 5
    buf = planner.allocate(blocks)
    region_offsets, _ = plan_regions(planner.region_sizes(blocks), planner.align)
    for pool_index, (pool, pool_offset) in enumerate(zip(planner.pools.values(), region_offsets)):
        placement = pool.placement(blocks)
        for field_index, field in enumerate(pool.fields):
            for row, block in [(0, 0), (pool.layers - 1, blocks - 1), (pool.layers // 2, 2)]:
                buf.zero_()
                view = pool.arenas[field.name].layer(row)[block]
                view.view(torch.uint8).fill_(0xFF)
                start, stop = pool.arenas[field.name].byte_range(row, block)
                start += pool_offset + placement.offsets[field_index]
                stop += pool_offset + placement.offsets[field_index]
                touched = buf.nonzero().flatten()
                assert touched.numel() == stop - start == field.nbytes
                assert touched[0].item() == start and touched[-1].item() == stop - 1


def test_target_and_draft_share_block_ids():
    target = MhaKvPool(layers=2, block_size=4, num_kv_heads=2, head_dim=8, kv_dtype=torch.float32)
    draft = MhaKvPool(layers=1, block_size=4, num_kv_heads=1, head_dim=16, kv_dtype=torch.float16)
    planner = PoolPlanner({"target": target, "draft": draft})
    blocks = planner.blocks_for_budget(64 * planner.block_bytes)
    planner.allocate(blocks)
    assert target.blocks == draft.blocks == blocks
    tk, _ = target.kv_views(1)
    dk, dv = draft.kv_views(0)
    assert tk.shape[0] == dk.shape[0] == dv.shape[0] == blocks
    dk.fill_(1.0)
    tk[7].fill_(2.0)  # writing a target block leaves the draft's same block id alone
    assert torch.all(dk == 1.0)
    planner.copy_blocks([7], [9])
    assert torch.equal(tk[9], tk[7]) and torch.all(dk[9] == 1.0)


def test_release_drops_views():
    pool = MhaKvPool(layers=1, block_size=4, num_kv_heads=1, head_dim=8, kv_dtype="float16")
    pool.allocate(3)
    pool.release()
    assert not pool.is_allocated
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.kv_views(0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=8), st.sampled_from([1, 16, 256, 4096]))
def test_regions_never_overlap_and_respect_alignment(sizes, align):
    offsets, total = plan_regions(sizes, align)
    assert all(o % align == 0 for o in offsets)
    ends = [o + s for o, s in zip(offsets, sizes)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:]))
    assert total == ends[-1]
    pieces = carve(aligned_empty(total, align=align), sizes, align)
    assert [p.numel() for p in pieces] == sizes


def test_carve_rejects_bad_buffers():
    sizes = [100, 300]
    _, total = plan_regions(sizes)
    with pytest.raises(ValueError, match=r"\[100, 300\] need 556"):
        carve(aligned_empty(total - 1), sizes)
    with pytest.raises(ValueError, match="uint8"):
        carve(torch.empty(total, dtype=torch.float32), sizes)
    with pytest.raises(ValueError, match="not aligned"):
        carve(aligned_empty(total + 1)[1:], sizes)


class Module:
    pass


def test_pool_rows_one_walk():
    target = [Module() for _ in range(3)]
    draft = [Module() for _ in range(2)]
    pairs = [("target", m) for m in target] + [("draft", m) for m in draft]
    rows = PoolRows().walk(pairs)
    assert [rows["target"][m] for m in target] == [0, 1, 2]
    assert [rows["draft"][m] for m in draft] == [0, 1]
    assert rows.row_counts() == {"target": 3, "draft": 2}
    with pytest.raises(KeyError, match="never walked"):
        rows["target"][Module()]
    with pytest.raises(KeyError, match="never walked"):
        rows["target"][draft[0]]  # walked, but for the other kind
    rows.invalidate()
    with pytest.raises(RuntimeError, match="walk"):
        rows["target"][target[0]]
    rows.walk(pairs)
    assert [rows["target"][m] for m in target] == [0, 1, 2]  # stable across re-walks
    with pytest.raises(ValueError, match="twice"):
        PoolRows().walk([("target", target[0]), ("target", target[0])])


@pytest.mark.parametrize("kwargs, arg", [
    (dict(layers=0), "layers"), (dict(block_size=-1), "block_size"), (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(head_dim=2.5), "head_dim"), (dict(kv_dtype="int8"), "kv_dtype"), (dict(kv_dtype=torch.int32), "kv_dtype"),
])
def test_pool_rejects_bad_geometry(kwargs, arg):
    geo = dict(layers=2, block_size=4, num_kv_heads=1, head_dim=8, kv_dtype="float16") | kwargs
    with pytest.raises(ValueError, match=arg):
        MhaKvPool(**geo)


def test_fields_and_arenas_reject_inconsistent_input():
    with pytest.raises(ValueError, match=r"shape\[1\]"):
        EntryField("k", 2, (4, 0), torch.float16)
    with pytest.raises(ValueError, match="shape"):
        EntryField("k", 2, (), torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        EntryField("k", 2, (4,), "complex64")
    with pytest.raises(ValueError, match="align"):
        EntryField("k", 2, (4,), torch.float32, align=2)
    field = EntryField("k", 2, (4,), torch.float16)
    with pytest.raises(ValueError, match="64 bytes"):
        LayerArena(field, 4, region=torch.empty(31, dtype=torch.uint8))
    with pytest.raises(ValueError, match="entries"):
        LayerArena(field, 0)
    with pytest.raises(ValueError, match="blocks"):
        MhaKvPool(1, 4, 1, 8).pool_bytes(0)
