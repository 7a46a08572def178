"""flashmla_backend.vllm.sparse_indices: vLLM's per-request top-k positions -> cache-wide token indices.

Needs no engine (the module is plain PyTorch). The expected values are written out per entry with Python
integers from the block table, so the vectorized conversion is checked against a loop that shares no code
with it; tests/test_vllm_sparse_cpu.py runs the conversion inside the plugin against vLLM's real classes.
"""
import pytest
import torch

from flashmla_backend.vllm.sparse_indices import SKIP, to_global_indices

BS = 64


def loop_conversion(indices, req_id, table, seq_lens, block_size=BS):
    out = []
    for t, row in enumerate(indices.tolist()):
        r = int(req_id[t])
        converted = []
        for pos in row:
            if pos < 0 or pos // block_size >= table.shape[1] or (seq_lens is not None and pos >= int(seq_lens[r])):
                converted.append(SKIP)
            else:
                converted.append(int(table[r, pos // block_size]) * block_size + pos % block_size)
        out.append(converted)
    return torch.tensor(out, dtype=torch.int32)


def random_case(seed, num_reqs=4, width=6, topk=40):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, width * BS + 1, (num_reqs,), generator=g, dtype=torch.int32)
    table = (torch.randperm(num_reqs * width + 10, generator=g)[: num_reqs * width] + 1).view(num_reqs, width)
    q_lens = torch.randint(1, 4, (num_reqs,), generator=g)
    req_id = torch.repeat_interleave(torch.arange(num_reqs), q_lens).to(torch.int32)
    # Positions anywhere from -3 to past the table; about a quarter -1.
    indices = torch.randint(-3, width * BS + 80, (req_id.shape[0], topk), generator=g)
    indices[torch.rand(indices.shape, generator=g) < 0.25] = -1
    return indices.to(torch.int32), req_id, table.to(torch.int32), seq_lens


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("with_seq_lens", [True, False])
def test_matches_the_per_entry_loop(seed, with_seq_lens):
    indices, req_id, table, seq_lens = random_case(seed)
    lens = seq_lens if with_seq_lens else None
    got = to_global_indices(indices, req_id, table, lens)
    assert got.dtype == torch.int32 and got.shape == indices.shape
    assert torch.equal(got, loop_conversion(indices, req_id, table, lens))


def test_worked_example():
    """Request 0 holds pages 7, 3; request 1 holds page 5 and has 10 tokens."""
    table = torch.tensor([[7, 3], [5, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([128, 10], dtype=torch.int32)
    req_id = torch.tensor([0, 1, 1], dtype=torch.int32)
    indices = torch.tensor([[0, 63, 64, 127, -1, 128],
                            [0, 9, 10, 63, -1, -7],
                            [5, -1, -1, -1, -1, -1]], dtype=torch.int32)
    got = to_global_indices(indices, req_id, table, seq_lens)
    want = torch.tensor([[7 * 64, 7 * 64 + 63, 3 * 64, 3 * 64 + 63, -1, -1],   # 128: past the table
                         [5 * 64, 5 * 64 + 9, -1, -1, -1, -1],                  # 10, 63: past seq_len 10
                         [5 * 64 + 5, -1, -1, -1, -1, -1]], dtype=torch.int32)  # the tail past the top-k length
    assert torch.equal(got, want)
    assert (got != SKIP).sum(dim=1).tolist() == [4, 2, 1]
    # Without seq_lens only the table bounds the positions: 10 and 63 of request 1 are then read.
    loose = to_global_indices(indices, req_id, table)
    assert loose[1, 2] == 5 * 64 + 10 and loose[1, 3] == 5 * 64 + 63


def test_the_loop_check_can_fail():
    """A conversion that ignored the request (always request 0's pages) must not pass the comparison."""
    indices, req_id, table, seq_lens = random_case(11)
    wrong = to_global_indices(indices, torch.zeros_like(req_id), table, seq_lens)
    assert not torch.equal(wrong, loop_conversion(indices, req_id, table, seq_lens))


def test_only_the_first_rows_are_read():
    """vLLM hands the whole top-k buffer's first T rows and req_id_per_token may be longer (a persistent buffer)."""
    indices, req_id, table, seq_lens = random_case(3)
    longer = torch.cat([req_id, torch.full((7,), 99, dtype=torch.int32)])
    assert torch.equal(to_global_indices(indices, longer, table, seq_lens),
                       loop_conversion(indices, req_id, table, seq_lens))


def test_bad_shapes_are_refused_naming_the_argument():
    indices, req_id, table, _ = random_case(0)
    with pytest.raises(ValueError, match="req_id_per_token"):
        to_global_indices(indices, req_id[:1], table)
    with pytest.raises(ValueError, match=r"indices must be \[num_tokens, topk\]"):
        to_global_indices(indices[None], req_id, table)
    with pytest.raises(ValueError, match="block_table"):
        to_global_indices(indices, req_id, table[0])


# ---- counted_lengths: the topk_length the plugin passes ----

def test_counted_lengths_worked_example():
    from flashmla_backend.vllm.sparse_indices import counted_lengths
    g = torch.tensor([[5, 9, -1, -1],     # the indexer's usual row of a short request: skips at the end
                      [-1, 3, -1, 8],     # a skip before the last entry that names a token stays a skip
                      [-1, -1, -1, -1],   # nothing: length 0
                      [1, 2, 3, 4]], dtype=torch.int32)
    lengths = counted_lengths(g)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [2, 4, 0, 4]
    assert counted_lengths(g[:0]).shape == (0,)


@pytest.mark.parametrize("seed", range(3))
def test_counted_lengths_keep_every_entry_that_names_a_token(seed):
    """Against a per-row loop: every entry >= 0 lies before the row's length, and the entry just before it
    names a token (the length is the shortest that keeps them all)."""
    from flashmla_backend.vllm.sparse_indices import counted_lengths
    indices, req_id, table, seq_lens = random_case(seed)
    g = to_global_indices(indices, req_id, table, seq_lens)
    g[0] = SKIP
    lengths = counted_lengths(g).tolist()
    for row, n in zip(g.tolist(), lengths):
        named = [j for j, v in enumerate(row) if v >= 0]
        assert n == (named[-1] + 1 if named else 0)
