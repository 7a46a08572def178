"""Tile scheduler: invariants of the Python mirror (CPU) and bit-identity of the GPU kernel with it."""
import random

import pytest
import torch

import flashmla_backend
from flashmla_backend import scheduler
from kit import PAGE, pieces_from_metadata

OVH = scheduler.FIXED_OVERHEAD_BLOCKS


def random_lengths(b: int, seed: int, zero_fraction: float = 0.1, max_len: int = 20000) -> list[int]:
    rng = random.Random(seed)
    return [0 if rng.random() < zero_fraction
            else rng.choice([1, 20, PAGE - 1, PAGE, PAGE + 1, rng.randint(1, max_len)])
            for _ in range(b)]


LENGTH_SETS = [
    [0],
    [1],
    [0, 0, 0],
    [PAGE],
    [65, 0, 8192],
    [32768] * 2,
    [4096] * 128,
    random_lengths(7, 1),
    random_lengths(128, 2),
    random_lengths(1000, 3, zero_fraction=0.3),
    random_lengths(4096, 4, max_len=4000),
]
PARTS = [1, 3, 66, 132]


def check_invariants(lengths: list[int], parts: int, meta: torch.Tensor, num_splits: torch.Tensor,
                     min_part_blocks: int = scheduler.MIN_PART_BLOCKS) -> None:
    b = len(lengths)
    assert meta.shape == (parts, 8) and meta.dtype == torch.int32
    assert num_splits.shape == (b + 1,) and num_splits.dtype == torch.int32
    blocks = [-(-n // PAGE) for n in lengths]
    covered = [[0] * nb for nb in blocks]
    owners = [[] for _ in range(b)]  # (part, split index) per piece, in part order
    total = sum(nb + OVH for nb in blocks)
    per_part = max(min_part_blocks, -(-(total - OVH) // parts))
    # Line model and piece mode: a part costs at most P + overhead. Whole-request mode (no request cut) may go
    # WHOLE_SLACK_PERCENT % over that.
    limit = per_part + OVH
    if int(num_splits[-1]) == b:
        limit = limit * (100 + scheduler.WHOLE_SLACK_PERCENT) // 100
    for p, pieces in enumerate(pieces_from_metadata(meta, lengths)):
        cost = 0
        for req, start, stop, split in pieces:
            assert 0 <= start <= stop <= lengths[req], (p, req, start, stop)
            assert start % PAGE == 0, (p, req, start)
            assert stop == lengths[req] or stop % PAGE == 0, (p, req, stop)
            assert stop > start or lengths[req] == 0, f"part {p} has an empty piece of non-empty request {req}"
            for blk in range(start // PAGE, -(-stop // PAGE)):
                covered[req][blk] += 1
            owners[req].append((p, split))
            cost += -(-stop // PAGE) - start // PAGE + OVH
        assert cost <= limit, f"part {p} costs {cost} > {limit} (P = {per_part})"
    for req in range(b):
        assert all(c == 1 for c in covered[req]), f"request {req}: block coverage {covered[req]}"
        assert len(owners[req]) >= 1, f"request {req} is computed by no part"
        n_splits = int(num_splits[req + 1] - num_splits[req])
        assert n_splits == len(owners[req]), (req, n_splits, owners[req])
        assert [s for _, s in owners[req]] == list(range(n_splits)), f"split indices of request {req}: {owners[req]}"
        if lengths[req] == 0:
            assert n_splits == 1
    assert int(num_splits[0]) == 0 and int(num_splits[-1]) <= b + parts


MIN_PART_BLOCKS = [scheduler.MIN_PART_BLOCKS, scheduler.SPARSE_MIN_PART_BLOCKS]


@pytest.mark.parametrize("min_part_blocks", MIN_PART_BLOCKS)
@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("lengths", LENGTH_SETS, ids=lambda l: f"b{len(l)}")
def test_mirror_invariants(lengths, parts, min_part_blocks):
    meta, num_splits = scheduler.schedule(torch.tensor(lengths, dtype=torch.int32), parts, min_part_blocks)
    check_invariants(lengths, parts, meta, num_splits, min_part_blocks)


def test_sparse_schedules_take_one_block_pieces():
    """The sparse kernel's schedule (SPARSE_MIN_PART_BLOCKS = 1): a row of 8 blocks on 66 parts is 8 one-block
    pieces, where the dense kernels' minimum gives 4 pieces of two."""
    lengths = torch.tensor([8 * PAGE], dtype=torch.int32)
    _, dense = scheduler.schedule(lengths, 66)
    _, sparse = scheduler.schedule(lengths, 66, scheduler.SPARSE_MIN_PART_BLOCKS)
    assert (int(dense[1]), int(sparse[1])) == (4, 8)


@pytest.mark.parametrize("rows,topk,h_q,want", [(1, 512, 128, 8), (1, 2048, 128, 32), (2, 512, 128, 16),
                                                 (1, 100, 64, 2), (3, 2048, 64, 96), (64, 2048, 128, 66),
                                                 (128, 128, 128, 66), (1, 64, 64, 1), (0, 2048, 128, 1)])
def test_sparse_parts_are_no_more_than_the_blocks(rows, topk, h_q, want):
    """The sparse schedule's part count (scheduler.sparse_num_sm_parts) is num_sm_parts capped at the rows' blocks, and
    the cap changes no piece: the busy rows of the metadata and the split counts are those of the uncapped schedule,
    only the parts that would have had no work are gone."""
    parts = scheduler.sparse_num_sm_parts(132, rows, topk, h_q)
    assert parts == want
    full = scheduler.num_sm_parts(132, 1, h_q)
    lengths = torch.full((rows,), topk, dtype=torch.int32)
    meta, splits = scheduler.schedule(lengths, parts, scheduler.SPARSE_MIN_PART_BLOCKS)
    meta_full, splits_full = scheduler.schedule(lengths, full, scheduler.SPARSE_MIN_PART_BLOCKS)
    busy = [r.tolist() for r in meta if r[0] <= r[2]]
    assert busy == [r.tolist() for r in meta_full if r[0] <= r[2]]
    assert torch.equal(splits, splits_full)
    if rows and parts < full:  # capped: every part has a block
        assert len(busy) == parts == rows * -(-topk // PAGE)


@pytest.mark.parametrize("length,parts,busy", [(8192, 66, 64), (8192, 132, 64), (8192 * 2, 66, 64),
                                               (PAGE * 66, 66, 33), (PAGE * 132, 66, 66), (1, 66, 1)])
def test_a_single_request_is_spread_over_the_parts(length, parts, busy):
    """The last request's trailing overhead does not count towards the part size: one request of 128
    blocks on 66 parts is 64 parts of 2 blocks (not 43 of 3); parts of at least MIN_PART_BLOCKS blocks."""
    meta, _ = scheduler.schedule(torch.tensor([length], dtype=torch.int32), parts)
    pieces = [p for p in pieces_from_metadata(meta, [length]) if p]
    assert len(pieces) == busy
    blocks = -(-length // PAGE)
    widest = max(-(-stop // PAGE) - start // PAGE for piece in pieces for _, start, stop, _ in piece)
    assert widest == max(min(blocks, scheduler.MIN_PART_BLOCKS), -(-blocks // parts))


def test_negative_lengths_count_as_zero():
    a = scheduler.schedule(torch.tensor([-5, 100, -1], dtype=torch.int32), 8)
    b = scheduler.schedule(torch.tensor([0, 100, 0], dtype=torch.int32), 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_balance_is_tight_for_uniform_batches():
    lengths = [8192] * 128
    meta, _ = scheduler.schedule(torch.tensor(lengths, dtype=torch.int32), 132)
    costs = []
    for pieces in pieces_from_metadata(meta, lengths):
        costs.append(sum(-(-stop // PAGE) - start // PAGE + OVH for _, start, stop, _ in pieces))
    total = 128 * (8192 // PAGE + OVH)
    # the makespan is within one block + one overhead of the perfect split
    assert max(costs) <= total / 132 + OVH + 1, costs
    assert sum(costs) <= total + OVH * 132


@pytest.mark.parametrize("lengths,parts,splits", [([8192], 132, [64]), ([8192], 66, [64]),
                                                 ([4096, 4096], 132, [32, 32]), ([8192 - 3 * PAGE], 132, [63]),
                                                 ([PAGE + 1], 132, [1])])
def test_small_batches_get_pieces_of_two_blocks(lengths, parts, splits):
    """Fewer blocks than parts: pieces of MIN_PART_BLOCKS blocks, not one (the FP8 kernels pay a virtual block for
    an odd piece; csrc/params.h: kMinPartBlocks), so b = 1 with 128 blocks has 64 splits on 66 or 132 parts."""
    assert scheduler.MIN_PART_BLOCKS == 2
    meta, num_splits = scheduler.schedule(torch.tensor(lengths, dtype=torch.int32), parts)
    assert [int(num_splits[i + 1] - num_splits[i]) for i in range(len(lengths))] == splits
    sizes = [-(-stop // PAGE) - start // PAGE for p in pieces_from_metadata(meta, lengths) for _, start, stop, _ in p]
    assert sizes.count(1) <= sum(-(-n // PAGE) % 2 for n in lengths), sizes  # a one-block piece only for an odd count
    check_invariants(lengths, parts, meta, num_splits)


@pytest.mark.parametrize("b,length,parts,per_part_requests", [(128, 8192, 66, 2), (256, 4096, 66, 4), (128, 8192, 33, 4),
                                                                (256, 8192, 132, 2)])
def test_whole_request_mode_for_uniform_batches(b, length, parts, per_part_requests):
    """Batch > parts with equal lengths: every request whole (no split, no combine), at most
    ceil(b / parts) requests per part, instead of the line model cutting about half of them."""
    lengths = [length] * b
    meta, num_splits = scheduler.schedule(torch.tensor(lengths, dtype=torch.int32), parts)
    assert num_splits.tolist() == list(range(b + 1))
    pieces = pieces_from_metadata(meta, lengths)
    assert max(len(p) for p in pieces) == per_part_requests
    assert all(start == 0 and stop == length for p in pieces for _, start, stop, _ in p)
    check_invariants(lengths, parts, meta, num_splits)


@pytest.mark.parametrize("lengths", [[8192] * 200, [8192] * 140, [200] * 50 + [20000] * 80])
def test_whole_request_mode_not_when_it_unbalances(lengths):
    """200 x 8192 keys on 66 parts would put 3-4 whole requests on a part (532 units against the line model's 408):
    the line model cuts instead; likewise when long requests follow short ones."""
    meta, num_splits = scheduler.schedule(torch.tensor(lengths, dtype=torch.int32), 66)
    assert int(num_splits[-1]) > len(lengths)
    check_invariants(lengths, 66, meta, num_splits)


def test_batch_within_parts_cuts_only_what_it_must():
    """Piece mode: b <= parts gives each busy part one piece of one request; uniform requests that fit in a part
    stay whole (no split, nothing to combine), and two per request split into equal halves."""
    lengths = [8192] * 128
    meta, num_splits = scheduler.schedule(torch.tensor(lengths, dtype=torch.int32), 132)
    assert num_splits.tolist() == list(range(129))
    busy = [p for p in pieces_from_metadata(meta, lengths) if p]
    assert busy == [[(i, 0, 8192, 0)] for i in range(128)]
    lengths = [8192] * 64
    meta, num_splits = scheduler.schedule(torch.tensor(lengths, dtype=torch.int32), 132)
    assert num_splits.tolist() == list(range(0, 129, 2))
    busy = [p for p in pieces_from_metadata(meta, lengths) if p]
    assert busy == [[(i, h * 4096, (h + 1) * 4096, h)] for i in range(64) for h in range(2)]
    # uneven lengths whose pieces of at most P blocks outnumber the parts keep the line model (parts span requests)
    lengths = [PAGE * 100, PAGE] * 40
    meta, _ = scheduler.schedule(torch.tensor(lengths, dtype=torch.int32), 100)
    assert any(len(p) > 1 for p in pieces_from_metadata(meta, lengths))


def test_num_sm_parts():
    assert scheduler.num_sm_parts(132, 1, 16) == 132
    assert scheduler.num_sm_parts(132, 1, 128) == 66
    assert scheduler.num_sm_parts(132, 1, 256) == 33
    assert scheduler.num_sm_parts(132, 8, 16) == 16
    assert scheduler.num_sm_parts(4, 8, 16) == 1


def test_public_metadata_on_cpu_uses_the_mirror():
    lengths = torch.tensor(random_lengths(50, 7), dtype=torch.int32)
    meta, num_splits = flashmla_backend.get_mla_metadata(lengths, 128, 1)
    want = scheduler.schedule(lengths, scheduler.num_sm_parts(132, 1, 128))
    assert torch.equal(meta, want[0]) and torch.equal(num_splits, want[1])


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("min_part_blocks", MIN_PART_BLOCKS)
@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("lengths", LENGTH_SETS + [[-3, 7, 0]], ids=lambda l: f"b{len(l)}")
def test_gpu_kernel_matches_mirror(lengths, parts, min_part_blocks):
    from flashmla_backend import ops

    seqlens = torch.tensor(lengths, dtype=torch.int32)
    meta, num_splits = ops._metadata_impl(seqlens.cuda(), parts, min_part_blocks)
    want_meta, want_splits = scheduler.schedule(seqlens, parts, min_part_blocks)
    assert torch.equal(meta.cpu(), want_meta), (meta.cpu()[:8], want_meta[:8])
    assert torch.equal(num_splits.cpu(), want_splits)


@pytest.mark.gpu
def test_gpu_metadata_in_cuda_graph_sees_new_lengths():
    seqlens = torch.tensor([100] * 16, dtype=torch.int32, device="cuda")
    flashmla_backend.get_mla_metadata(seqlens, 128, 1)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta, num_splits = flashmla_backend.get_mla_metadata(seqlens, 128, 1)
    parts = meta.shape[0]
    for seed in range(3):
        new = random_lengths(16, 100 + seed, max_len=5000)
        seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = scheduler.schedule(torch.tensor(new, dtype=torch.int32), parts)
        assert torch.equal(meta.cpu(), want[0]) and torch.equal(num_splits.cpu(), want[1])
