"""A CUDA graph's padding rows, emulated on the CPU: decode and speculative steps padded to a graph bucket as on
CUDA (3 sequences run as 4), the padding rows' attention outputs holding whatever their memory held. What the
padding holds must not reach a real row: the same tokens and logprobs, bit for bit, as with zeros there."""
import pytest
import torch

from rollout_engine import Engine, SamplingParams
from rollout_engine.cuda_graphs import buckets
from rollout_engine.spec.state import max_batch

PROMPTS = [[7, 8, 9, 10, 11] * 4, [40, 41, 42] * 6, [50, 51, 52, 53] * 5]
PARAMS = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3)  # top logprobs would run eagerly


class EagerGraphs:
    """StepGraphs' bucket() and run() without a capture: each step runs eagerly at its bucket's size."""

    def __init__(self, step, max_rows: int):
        self.step, self.sizes = step, buckets(max_rows)

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def run(self, size: int) -> torch.Tensor:
        return self.step(size)


def padded_like_cuda(engine: Engine, leftover: float) -> None:
    """Pad `engine`'s decode, verify and draft steps to graph buckets, the padding rows of every attention output
    set to `leftover` (a Triton attention leaves rows that own no query as it found them)."""
    r, spec = engine.runner, engine.speculator
    r.graphs = EagerGraphs(r.graph_step, r.buffers.max_rows)
    if spec is not None:
        spec.graphs = EagerGraphs(spec.graph_step, max_batch(r))
        spec.proposer.graphs = EagerGraphs(spec.proposer.graph_step, max_batch(r))
    attend = engine.ops.rope_store_attention

    def leaving(*args, **kwargs):
        out = attend(*args, **kwargs)
        out[int(args[10][-1]):] = leftover  # args[10]: query_start_loc
        return out

    engine.ops.rope_store_attention = leaving


def outputs(engine: Engine):
    steps = engine.runner.graphs.run
    engine.runner.graphs.run = lambda size: padded.append(size) or steps(size)
    padded = []
    done = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert 4 in padded or engine.speculator is not None  # 3 sequences decoded as 4
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in done]


@pytest.fixture
def tame(tame_checkpoint):
    """An untied llama3 with the projections at a quarter (fp8 keeps its greedy tokens there)."""
    return tame_checkpoint("llama3")[0]


@pytest.mark.parametrize("quantization", ["fp8", "fp8_lm_head"])
@pytest.mark.parametrize("leftover", [1e30, float("nan")])
def test_padding_rows_reach_no_real_row_of_an_fp8_decode(tame, quantization, leftover):
    """Every fp8 activation scale, the LM head's too (fp8_lm_head), counts only the rows that hold tokens: with the
    LM head's counting the padding, NaN there made every real row's logits NaN (NonFiniteLogitsError on a healthy
    step) and 1e30 moved their logprobs."""
    runs = []
    for value in (0.0, leftover):
        engine = Engine(tame, device="cpu", kv_cache_memory=1 << 22, quantization=quantization, max_num_seqs=8)
        padded_like_cuda(engine, value)
        runs.append(outputs(engine))
    assert runs[1] == runs[0]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_padding_rows_of_a_speculative_step_own_no_query(tame, quantization):
    """A padded verify or draft pass gave its padding rows k + 1 (or 2) queries over block 0: they counted into
    every fp8 activation scale, and block 0, which no sequence had written since the wake, held what the memory
    held (the trainer's bytes; NaN here), so the step's logits were NaN. Padding rows now own no query. The
    target is its own draft (every proposal accepted); a rollout and a sleep first send block 0 to the free list's
    end."""
    runs = []
    for fill in (0, 0xFF):
        engine = Engine(tame, device="cpu", kv_cache_memory=1 << 22, quantization=quantization, max_num_seqs=8,
                        draft_model=str(tame), num_speculative_tokens=3)
        engine.generate([[1, 2, 3] * 6, [4, 5, 6] * 6, [30, 31, 32] * 6], PARAMS, use_tqdm=False)
        engine.sleep(level=1)
        engine.wake()
        engine.kv.buf.fill_(fill)
        padded_like_cuda(engine, float("nan"))
        runs.append(outputs(engine))
        assert engine.stats()["spec_steps"] > 0
    assert runs[1] == runs[0]
