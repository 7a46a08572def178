"""The decode plan the engine adapters share (flashmla_backend.plan): fresh and persistent metadata, bounds."""
import pytest
import torch

import flashmla_backend
from flashmla_backend import device, geometry, scheduler
from flashmla_backend.plan import DecodePlan, DecodeSchedule, DecodeStep

CPU = torch.device("cpu")


def lens(*values: int, dev=CPU) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=dev)


def expected(seqlens: torch.Tensor, query_len: int, heads: int, kv_heads: int = 1):
    return flashmla_backend.get_mla_metadata(seqlens, query_len * heads // kv_heads, kv_heads)


def assert_same(got: DecodeSchedule, want) -> None:
    assert torch.equal(got.tile_scheduler_metadata, want[0]) and torch.equal(got.num_splits, want[1])


def test_eager_steps_get_fresh_tensors_equal_to_get_mla_metadata():
    plan = DecodePlan(CPU, num_q_heads=16)
    assert not plan.has_graph_buffers and plan.max_batch == 0
    step = DecodeStep(cache_seqlens=lens(5, 1000, 64, 0), query_len=1)
    first = plan.schedule(step, graph=False)
    second = plan.schedule(step, graph=False)
    assert_same(first, expected(step.cache_seqlens, 1, 16))
    assert first.tile_scheduler_metadata.data_ptr() != second.tile_scheduler_metadata.data_ptr()
    meta, splits = first  # unpacks like get_mla_metadata's pair
    assert meta.shape[1] == geometry.META_INTS and splits.shape == (5,)


def test_graph_buffers_are_sized_for_the_device_and_the_largest_batch():
    plan = DecodePlan(CPU, num_q_heads=16, max_batch=8, max_batch_name="max_num_seqs")
    assert plan.has_graph_buffers and plan.max_batch == 8
    assert plan.cg_tile_scheduler_metadata.shape == (device.sm_count(CPU), geometry.META_INTS)
    assert plan.cg_num_splits.shape == (9,)
    assert plan.cg_tile_scheduler_metadata.dtype == plan.cg_num_splits.dtype == torch.int32


def test_graph_steps_reuse_the_buffers_and_refresh_their_values():
    plan = DecodePlan(CPU, num_q_heads=16, max_batch=4)
    buf_md, buf_splits = plan.cg_tile_scheduler_metadata.data_ptr(), plan.cg_num_splits.data_ptr()
    captured = plan.schedule(DecodeStep(lens(5, 1000, 64, 1), 2), graph=True)
    assert captured.tile_scheduler_metadata.data_ptr() == buf_md
    assert captured.num_splits.data_ptr() == buf_splits
    assert_same(captured, expected(lens(5, 1000, 64, 1), 2, 16))
    before = captured.tile_scheduler_metadata.clone()

    replay = plan.schedule(DecodeStep(lens(3000, 2, 129, 700), 2), graph=True)  # same shape, new lengths
    assert replay.tile_scheduler_metadata.data_ptr() == buf_md and replay.num_splits.data_ptr() == buf_splits
    want = expected(lens(3000, 2, 129, 700), 2, 16)
    assert_same(captured, want)  # the capture-time views read this step's values
    assert not torch.equal(before, want[0])


def test_graph_views_follow_the_step_shape():
    """Fewer requests and more query rows per part (fewer parts): views at the buffers' starts."""
    plan = DecodePlan(CPU, num_q_heads=128, max_batch=16)
    seqlens = lens(100, 7000)
    got = plan.schedule(DecodeStep(seqlens, 2), graph=True)
    parts = scheduler.num_sm_parts(device.sm_count(CPU), 1, 2 * 128)
    assert got.tile_scheduler_metadata.shape == (parts, geometry.META_INTS) and parts < device.sm_count(CPU)
    assert got.num_splits.shape == (3,)
    assert got.tile_scheduler_metadata.data_ptr() == plan.cg_tile_scheduler_metadata.data_ptr()
    assert got.num_splits.data_ptr() == plan.cg_num_splits.data_ptr()
    assert_same(got, expected(seqlens, 2, 128))


def test_kv_heads_divide_the_query_rows():
    plan = DecodePlan(CPU, num_q_heads=32, num_kv_heads=2, max_batch=2)
    seqlens = lens(900, 33)
    got = plan.schedule(DecodeStep(seqlens, 1), graph=True)
    assert_same(got, expected(seqlens, 1, 32, 2))
    assert got.tile_scheduler_metadata.shape[0] == scheduler.num_sm_parts(device.sm_count(CPU), 2, 16)


def test_graph_batch_above_the_maximum_is_refused_before_anything_is_written():
    plan = DecodePlan(CPU, num_q_heads=16, max_batch=2, max_batch_name="max_num_seqs")
    plan.schedule(DecodeStep(lens(10, 20), 1), graph=True)
    kept = plan.cg_num_splits.clone()
    with pytest.raises(RuntimeError, match=r"3 requests exceeds the 2 \(max_num_seqs\)"):
        plan.schedule(DecodeStep(lens(10, 20, 30), 1), graph=True)
    assert torch.equal(plan.cg_num_splits, kept)
    # Eager batches are not bounded by the graph buffers.
    assert_same(plan.schedule(DecodeStep(lens(10, 20, 30), 1), graph=False), expected(lens(10, 20, 30), 1, 16))


def test_graph_step_without_buffers_is_refused():
    plan = DecodePlan(CPU, num_q_heads=16)
    with pytest.raises(RuntimeError, match="before the graph metadata buffers were allocated"):
        plan.schedule(DecodeStep(lens(10), 1), graph=True)


def test_more_parts_than_the_buffer_holds_is_refused():
    plan = DecodePlan(CPU, num_q_heads=16, max_batch=2, max_batch_name="cuda_graph_max_bs")
    plan.cg_tile_scheduler_metadata = torch.zeros((4, geometry.META_INTS), dtype=torch.int32)  # a smaller device
    with pytest.raises(RuntimeError, match=r"\d+ parts, 2 requests\) exceeds the CUDA-graph buffers \(4 parts"):
        plan.schedule(DecodeStep(lens(10, 20), 1), graph=True)


def test_reallocating_gives_new_buffers_of_the_new_size():
    plan = DecodePlan(CPU, num_q_heads=16, max_batch=2)
    old = plan.cg_num_splits
    plan.allocate_graph_buffers(6)
    assert plan.max_batch == 6 and plan.cg_num_splits.shape == (7,) and plan.cg_num_splits is not old
    plan.schedule(DecodeStep(lens(*range(1, 7)), 1), graph=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_q_heads=0), "query heads"),
    (dict(num_q_heads=16, num_kv_heads=3), "query heads"),
    (dict(num_q_heads=16, max_batch=0), "maximum batch"),
])
def test_bad_construction_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodePlan(CPU, **kwargs)


def test_scheduler_argument_errors_pass_through():
    plan = DecodePlan(CPU, num_q_heads=16)
    with pytest.raises(TypeError):
        plan.schedule(DecodeStep(torch.tensor([10], dtype=torch.int64), 1), graph=False)


# ---- GPU: no host sync, CUDA-graph replay ---------------------------------------------------------------

@pytest.mark.gpu
def test_graph_schedule_has_no_host_sync_and_replays_fresh_metadata():
    """A captured decode kernel replays with the metadata of each later schedule() call."""
    dev = torch.device("cuda")
    heads, max_pages = 16, 40
    plan = DecodePlan(dev, num_q_heads=heads, max_batch=4)
    assert plan.cg_tile_scheduler_metadata.shape[0] == device.sm_count(dev)
    gen = torch.Generator(device="cpu").manual_seed(0)
    cache = torch.randn((4 * max_pages + 1, geometry.PAGE_SIZE, 1, geometry.HEAD_DIM_K), generator=gen)
    cache = cache.to(dev, torch.bfloat16)
    table = torch.randperm(4 * max_pages, generator=gen).add_(1).view(4, max_pages).to(dev, torch.int32)
    q = torch.randn((4, 1, heads, geometry.HEAD_DIM_K), generator=gen).to(dev, torch.bfloat16)
    seqlens = lens(5, 1000, 64, 1, dev=dev)

    def decode(meta, splits):
        return flashmla_backend.flash_mla_with_kvcache(q, cache, table, seqlens, geometry.HEAD_DIM_V, meta, splits,
                                                       softmax_scale=0.1)[0]

    torch.cuda.set_sync_debug_mode("error")
    try:
        sched = plan.schedule(DecodeStep(seqlens, 1), graph=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode(*sched)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(*sched)

    for new in ((2500, 3, 129, 2000), (1, 1, 1, 2559)):
        seqlens.copy_(lens(*new, dev=dev))
        plan.schedule(DecodeStep(seqlens, 1), graph=True)
        graph.replay()
        want = decode(*expected(seqlens, 1, heads))
        torch.testing.assert_close(out, want, atol=0, rtol=0)
