"""What a step writes into the StepBuffers' host twin: the block-table rows match every sequence's table
whatever happened to the tables in between (growth, a new list after a free, reordering, padding), and a
graph bucket's padding rows sample unfiltered."""
import random

import torch

from rollout_kernels.sampling import _truncated_rows
from rollout_engine.model_runner import ModelRunner
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.sequence import Sequence
from rollout_engine.step_buffers import StepBuffers

BLOCK = 4


def test_block_table_rows_follow_every_change_of_the_tables():
    rng = random.Random(0)
    buffers = StepBuffers(max_tokens=64, max_rows=8, max_blocks=16, device=torch.device("cpu"))
    runner = ModelRunner(None, None, BLOCK, torch.device("cpu"), buffers, use_graphs=False)
    seqs = []
    for i in range(6):
        seq = Sequence(i, 0, list(range(9)), SamplingParams(), seed=i)
        seq.block_table = [rng.randrange(100) for _ in range(3)]
        seqs.append(seq)
    for step in range(200):
        seq = rng.choice(seqs)
        change = rng.randrange(5)
        if change == 0 and len(seq.block_table) < 16:
            seq.block_table += [rng.randrange(100)]  # grow, as BlockManager.grow does
        elif change == 1:  # freed and re-admitted: a new list, often just as long as the old one
            seq.block_table = [rng.randrange(100) for _ in range(len(seq.block_table))]
        elif change == 2:
            rng.shuffle(seqs)  # the batch's order changes, so rows change owners
        elif change == 3:
            runner.write_padding(3, 3, 8, 1)  # a graph bucket's padding rows are rewritten
        batch = seqs[: rng.randint(1, len(seqs))]
        for s in batch:
            s.token_ids = list(range(len(s.block_table) * BLOCK))
        runner.write_tokens(batch, [len(s) - 1 for s in batch], [[0]] * len(batch))
        rows = buffers.host["block_tables"]
        for i, s in enumerate(batch):
            assert rows[i, : len(s.block_table)].tolist() == s.block_table, (step, i)


def test_padding_rows_sample_without_filters():
    """A bucket's padding rows are sampled and dropped. With the top-k/top-p/min-p of an earlier, larger batch
    (or the zeros a capture leaves) each would take the kernels' whole-row filtered walk: on an H200 one
    top-p walk over 128k logits took about 300 us, so the padding, not the batch, would set the step's pace."""
    buffers = StepBuffers(max_tokens=64, max_rows=8, max_blocks=16, device=torch.device("cpu"))
    runner = ModelRunner(None, None, BLOCK, torch.device("cpu"), buffers, use_graphs=False)

    def truncated(rows: int) -> list[bool]:
        h = buffers.host
        return _truncated_rows(1000, *(torch.from_numpy(h[n][:rows]) for n in ("top_k", "top_p", "min_p"))).tolist()

    runner.write_padding(0, 0, 8, 1)  # what capture writes into zeroed buffers
    assert truncated(8) == [False] * 8
    filtered = SamplingParams(top_k=5, top_p=0.5, min_p=0.1)
    runner.write_sampling([Sequence(i, 0, [1, 2], filtered, seed=i) for i in range(8)])
    runner.write_sampling([Sequence(i, 0, [1, 2], SamplingParams(), seed=i) for i in range(3)])
    runner.write_padding(3, 3, 8, 1)
    assert truncated(8) == [False] * 8
    runner.write_sampling([Sequence(0, 0, [1, 2], filtered, seed=0)])
    runner.write_padding(1, 1, 2, 1)
    assert truncated(2) == [True, False]  # the real row keeps its filters
