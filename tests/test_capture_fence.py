"""An engine dropped while another engine captures its CUDA graphs, or allocates into its memory pools (which torch's
allocator counts as a capture too): torch aborts the process if a memory pool is destroyed during any capture, so
the dropped engine's pools are kept until the last capture ends. CUDA also refuses page-locking calls during a
graph capture, on any thread: the level-1 host buffer is registered between captures and unregistered after them.

The fence is plain Python, checked here with stand-in pools that record whether a capture was underway when they
went; the GPU test drops a real engine in the middle of another's capture."""
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from rollout_engine.capture_fence import CAPTURES
from rollout_engine.memory import DeviceMemory, HostStash

gone: list[str] = []  # (pool tag, whether a capture was underway) as each stand-in pool is destroyed
underway = threading.Event()


class Pool:
    def __init__(self, tag: str):
        self.tag = tag

    def __del__(self):
        gone.append((self.tag, underway.is_set()))


def memory_with_pools(tags) -> DeviceMemory:
    """A DeviceMemory whose saver (torch_memory_saver, CUDA only) is a stand-in holding a pool per tag."""
    memory = DeviceMemory(torch.device("cpu"))
    pools = {(f"{memory.prefix}{tag}#0", False, False, "", 0): Pool(tag) for tag in tags}
    pools[("another-engine/weights#0", False, False, "", 0)] = Pool("another engine's")
    memory.saver = SimpleNamespace(_impl=SimpleNamespace(_mem_pools=pools))
    return memory


@pytest.fixture(autouse=True)
def clean():
    gone.clear()
    underway.clear()
    yield


def capture(body):
    with CAPTURES.capturing():
        underway.set()
        try:
            body()
        finally:
            underway.clear()


def test_without_a_capture_the_pools_go_at_once():
    memory = memory_with_pools(["weights", "kv_cache"])
    memory.close()
    assert sorted(gone) == [("kv_cache", False), ("weights", False)]
    assert list(memory.saver._impl._mem_pools) == [("another-engine/weights#0", False, False, "", 0)]


def test_an_engine_closed_during_a_capture_keeps_its_pools_until_it_ends():
    memory = memory_with_pools(["weights", "kv_cache"])

    def body():
        memory.close()
        assert gone == []  # not destroyed inside the capture ...
        assert len(memory.saver._impl._mem_pools) == 1  # ... though the saver no longer hands them out
    capture(body)
    assert sorted(gone) == [("kv_cache", False), ("weights", False)]  # ... and destroyed right after


def test_a_pool_forgotten_on_another_thread_during_a_capture_waits_for_its_end():
    memory = memory_with_pools(["kv_cache"])

    def body():
        other = threading.Thread(target=memory.forget, args=("kv_cache",))
        other.start()
        other.join()
        assert gone == []
    capture(body)
    assert gone == [("kv_cache", False)]


def test_nested_captures_keep_the_pools_until_the_outermost_ends():
    memory = memory_with_pools(["weights"])
    with CAPTURES.capturing():
        capture(memory.close)
        underway.set()  # still inside the outer capture
        assert gone == []
        underway.clear()
    assert gone == [("weights", False)]


def test_an_engine_closed_while_another_allocates_in_its_region_keeps_its_pools_until_it_ends():
    """torch_memory_saver's region() enters torch.cuda.use_mem_pool, which the allocator lists among the captures
    underway: engine B building its weights or KV pool is a capture to it. Engine A is dropped meanwhile (here on
    another thread; a collection B's allocations set off does the same)."""
    a = memory_with_pools(["weights", "kv_cache"])
    b = DeviceMemory(torch.device("cpu"))

    @contextmanager
    def use_mem_pool(tag):  # what the saver's region does, as torch's allocator sees it
        underway.set()
        try:
            yield
        finally:
            underway.clear()
    b.saver = SimpleNamespace(region=use_mem_pool)
    with b.region("weights"):
        other = threading.Thread(target=a.close)
        other.start()
        other.join()
        assert gone == []
    assert sorted(gone) == [("kv_cache", False), ("weights", False)]


def test_a_capture_that_fails_keeps_the_pools_until_a_later_one_ends():
    """A failed graph capture may be left in torch's list of captures underway: destroying a pool then would
    abort, so they wait for a capture that ends."""
    memory = memory_with_pools(["weights"])

    def fail():
        memory.close()
        raise RuntimeError("the capture failed")
    with pytest.raises(RuntimeError, match="the capture failed"):
        capture(fail)
    assert gone == []
    with CAPTURES.capturing():
        pass
    assert gone == [("weights", False)]


def test_emptying_the_cache_during_a_capture_waits_for_its_end(monkeypatch):
    """torch.cuda.empty_cache() asserts the same as a pool's destruction: another thread's sleep (or a pool
    forgotten) while an engine is built or captures its graphs empties the cache once the capture ends."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(underway.is_set()))
    CAPTURES.empty_cache()
    assert emptied == [False]

    def body():
        for _ in range(2):
            other = threading.Thread(target=CAPTURES.empty_cache)
            other.start()
            other.join()
        assert emptied == [False]
    capture(body)
    assert emptied == [False, False]  # once, after the capture


ENGINE_DROPPED_MID_CAPTURE = textwrap.dedent("""
    import contextlib
    import sys
    import weakref
    import torch
    from rollout_engine import Engine, SamplingParams

    kwargs = dict(device="cuda", kv_cache_memory=64 << 20, max_num_seqs=4)
    held = [Engine(sys.argv[1], **kwargs)]
    a = weakref.ref(held[0])

    def drop():  # engine A's last reference goes while B's capture is underway
        if held:
            held.clear()
            print("A freed during a capture:", a() is None)

    if sys.argv[2] == "graph":  # B's first CUDA graph capture
        enter = torch.cuda.graph.__enter__
        torch.cuda.graph.__enter__ = lambda self: (enter(self), drop())[0]
    else:  # B allocating its weights into its torch_memory_saver pool (torch.cuda.use_mem_pool)
        use_mem_pool = torch.cuda.use_mem_pool

        @contextlib.contextmanager
        def use_then_drop(*args, **kwargs):
            with use_mem_pool(*args, **kwargs):
                drop()
                yield
        torch.cuda.use_mem_pool = use_then_drop
    b = Engine(sys.argv[1], **kwargs)
    out = b.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print("generated", len(out[0].outputs[0].token_ids))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("during", ["graph", "pool"])
def test_an_engine_dropped_during_another_engines_capture_leaves_the_process_alive(hf_checkpoint, during):
    path, _ = hf_checkpoint("qwen2")
    run = subprocess.run([sys.executable, "-c", ENGINE_DROPPED_MID_CAPTURE, str(path), during], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "generated 4" in run.stdout, run.stderr[-3000:]
    assert "A freed during a capture: True" in run.stdout  # else this test could not fail


ENGINE_CAPTURES_WHILE_ANOTHER_THREAD_ALLOCATES = textwrap.dedent("""
    import sys
    import threading
    import time
    import torch
    from rollout_engine import Engine, SamplingParams
    from rollout_engine.memory import DeviceMemory

    memory = DeviceMemory(torch.device("cuda"))  # another engine's regions
    print("regions are pools:", memory.saver is not None)
    region, captures = {}, []

    def allocate():
        with memory.region("kv_cache"):
            region["opened"] = time.monotonic()
            region["tensor"] = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            time.sleep(0.5)

    enter, leave = torch.cuda.graph.__enter__, torch.cuda.graph.__exit__

    def entering(self):
        if not captures:  # the other thread's region would open now, before the first graph capture begins
            threading.Thread(target=allocate).start()
            time.sleep(0.3)
        captures.append(None)
        return enter(self)

    def leaving(self, *exc):
        captures[-1] = time.monotonic()
        return leave(self, *exc)
    torch.cuda.graph.__enter__, torch.cuda.graph.__exit__ = entering, leaving
    b = Engine(sys.argv[1], device="cuda", kv_cache_memory=64 << 20, max_num_seqs=4)
    while "opened" not in region:
        time.sleep(0.01)
    print("captures:", len(captures), "region opened after them:", region["opened"] > captures[-1])
    out = b.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print("generated", len(out[0].outputs[0].token_ids))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_captures_its_graphs_while_another_thread_allocates_in_a_region(hf_checkpoint):
    """torch.cuda.graph empties the cache as it begins, which asserts (the process aborts) while another thread
    allocates into a pool: the region waits for the graph captures to end."""
    path, _ = hf_checkpoint("qwen2")
    run = subprocess.run([sys.executable, "-c", ENGINE_CAPTURES_WHILE_ANOTHER_THREAD_ALLOCATES, str(path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "generated 4" in run.stdout, run.stderr[-3000:]
    assert "regions are pools: True" in run.stdout  # else this test could not fail
    assert "region opened after them: True" in run.stdout, run.stdout

def test_between_captures_waits_for_the_captures_underway_and_holds_off_new_ones():
    order = []
    entered, go_on = threading.Event(), threading.Event()

    def register():
        with CAPTURES.between_captures():
            order.append(("register", underway.is_set()))
            entered.set()
            go_on.wait(5)

    def body():
        other = threading.Thread(target=register)
        other.start()
        assert not entered.wait(0.2), "a registration ran during a capture"
        return other
    other = []
    capture(lambda: other.append(body()))
    assert entered.wait(5) and order == [("register", False)]

    def start_capture():
        capture(lambda: order.append(("capture", True)))
    late = threading.Thread(target=start_capture)
    late.start()
    late.join(0.2)
    assert order == [("register", False)], "a capture began while a registration ran"
    go_on.set()
    late.join(5)
    other[0].join(5)
    assert order == [("register", False), ("capture", True)]


def test_after_captures_defers_until_the_last_capture_ends_even_a_failed_one():
    calls = []
    CAPTURES.after_captures(lambda: calls.append(underway.is_set()))
    assert calls == [False]

    def fail():
        CAPTURES.after_captures(lambda: calls.append(underway.is_set()))
        assert calls == [False]
        raise RuntimeError("the capture failed")
    with pytest.raises(RuntimeError, match="the capture failed"):
        capture(fail)
    assert calls == [False, False]  # CUDA's capture mode ended with it: unregistering is allowed again


def test_a_host_stash_registers_and_unregisters_its_pieces_outside_captures(monkeypatch):
    """The level-1 host buffer is page-locked on a background thread while the engine may (re)capture graphs, or
    another engine may: each piece waits for the captures underway. A stash dropped during a capture (a
    collection on the capturing thread) unregisters after it ends."""
    calls, ranges, unregistered, current = [], [], [], ["cuda:0"]  # `current`: the thread's CUDA device
    fake = SimpleNamespace(cudaHostRegister=lambda ptr, n, flags: calls.append(("register", underway.is_set()))
                           or ranges.append((ptr, ptr + n, current[-1])) or 0,
                           cudaHostUnregister=lambda ptr: calls.append(("unregister", underway.is_set()))
                           or unregistered.append(ptr) or 0)

    @contextmanager
    def on_device(device):
        current.append(str(device))
        yield
        current.pop()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", on_device)
    monkeypatch.setattr(HostStash, "PIN_CHUNK", 1 << 20)
    size = (1 << 20) + 100  # not a whole number of pages
    tensors = {f"w{i}": SimpleNamespace(device=torch.device("cuda:1"), numel=lambda: size, element_size=lambda: 1)
               for i in range(3)}
    stash = HostStash()

    def body():
        stash.reserve(tensors)
        time.sleep(0.3)
        assert calls == []
    capture(body)
    stash.wait()
    assert calls == [("register", False)] * 3
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "the pieces are contiguous"
    assert all(begin % HostStash.PAGE == 0 for begin, _, _ in ranges[1:]), "a piece shares no page with the last"
    assert ranges[0][0] == stash.buf.untyped_storage().data_ptr(), "the storage's start is registered (is_pinned)"
    assert ranges[-1][1] == stash.buf.data_ptr() + stash.buf.numel() >= stash.buf.data_ptr() + 3 * size
    assert {device for _, _, device in ranges} == {"cuda:1"}, "registered for another device than the engine's"

    def drop():
        nonlocal stash
        stash = None
        assert len(calls) == 3
    capture(drop)
    assert calls[3:] == [("unregister", False)] * 3
    assert sorted(unregistered) == [begin for begin, _, _ in ranges]


def test_a_capture_does_not_begin_while_a_deferred_or_immediate_call_runs():
    """after_captures(fn) runs fn under the fence: a capture on another thread waits for an unregistration."""
    running, order = threading.Event(), []

    def slow():
        running.set()
        time.sleep(0.3)
        order.append("unregistered")
    caller = threading.Thread(target=CAPTURES.after_captures, args=(slow,))
    caller.start()
    assert running.wait(5)
    capture(lambda: order.append("captured"))
    caller.join(5)
    assert order == ["unregistered", "captured"]


def test_a_failure_when_the_last_capture_ends_still_runs_the_deferred_calls_and_wakes_registrations(monkeypatch):
    def fail():
        raise RuntimeError("empty_cache failed")
    monkeypatch.setattr(torch.cuda, "empty_cache", fail)
    calls, registered = [], threading.Event()

    def register():
        with CAPTURES.between_captures():
            registered.set()

    def body():
        CAPTURES.empty_cache()  # deferred to the capture's end, where it raises
        CAPTURES.after_captures(lambda: calls.append("unregistered"))
        threading.Thread(target=register).start()
    with pytest.raises(RuntimeError, match="empty_cache failed"):
        capture(body)
    assert calls == ["unregistered"]
    assert registered.wait(2), "a registration still waits for captures though none is underway"


def test_a_deferred_call_that_raises_leaves_none_of_the_others_for_a_later_capture():
    """Every call deferred to a capture's end runs there; the first error is raised once all have run."""
    calls = []

    def fail(n):
        calls.append(n)
        raise RuntimeError(f"unregistration {n} failed")

    def body():
        CAPTURES.after_captures(lambda: fail(1))
        CAPTURES.after_captures(lambda: calls.append(2))
        CAPTURES.after_captures(lambda: fail(3))
    with pytest.raises(RuntimeError, match="unregistration 1 failed") as raised:
        capture(body)
    assert calls == [1, 2, 3]
    assert any("unregistration 3 failed" in note for note in raised.value.__notes__), "the later error is lost"
    capture(lambda: None)
    assert calls == [1, 2, 3], "a call ran again at a later capture's end"


def test_a_failed_capture_raises_its_own_error_with_the_deferred_calls_errors_as_notes():
    def body():
        CAPTURES.after_captures(lambda: (_ for _ in ()).throw(RuntimeError("unregistration failed")))
        raise ValueError("the capture failed")
    with pytest.raises(ValueError, match="the capture failed") as raised:
        capture(body)
    assert any("unregistration failed" in note for note in raised.value.__notes__)


def test_a_graph_capture_runs_alone_between_other_threads_captures():
    """torch.cuda.graph empties the cache as it begins, which asserts while any capture is underway: a graph
    capture waits for another thread's region to end, and a region or another graph capture begun meanwhile
    waits for it."""
    order, region_open, region_close = [], threading.Event(), threading.Event()

    def region():
        with CAPTURES.capturing():
            order.append("region begins")
            region_open.set()
            region_close.wait(5)
            order.append("region ends")

    def graph(name, started=None):
        with CAPTURES.capturing(graph=True):
            order.append(f"{name} begins")
            if started is not None:
                started.set()
            time.sleep(0.2)
            order.append(f"{name} ends")

    first = threading.Thread(target=region)
    first.start()
    assert region_open.wait(5)
    graph_started = threading.Event()
    second = threading.Thread(target=graph, args=("graph", graph_started))
    second.start()
    assert not graph_started.wait(0.2), "a graph capture began during another thread's region"
    region_close.set()
    assert graph_started.wait(5)
    late = [threading.Thread(target=region), threading.Thread(target=graph, args=("second graph",))]
    for thread in late:
        thread.start()
    for thread in [first, second, *late]:
        thread.join(5)
    assert order[:4] == ["region begins", "region ends", "graph begins", "graph ends"], order
    assert sorted(order[4:]) == ["region begins", "region ends", "second graph begins", "second graph ends"]
    assert order[4].split(" begins")[0] == order[5].split(" ends")[0], "two captures overlapped: " + str(order)


def test_captures_nested_in_a_threads_own_graph_capture_go_on():
    """A region or graph capture inside the thread's own graph capture does not wait for it (it would wait for
    itself); the fence counts it, and other threads still wait until the outermost ends."""
    done, other_ran = [], threading.Event()

    def other():
        with CAPTURES.capturing():
            other_ran.set()

    with CAPTURES.capturing(graph=True):
        with CAPTURES.capturing():
            with CAPTURES.capturing(graph=True):
                done.append("nested")
        waiting = threading.Thread(target=other)
        waiting.start()
        assert not other_ran.wait(0.2), "another thread's region began during a graph capture"
    assert done == ["nested"] and other_ran.wait(5)
    waiting.join(5)
