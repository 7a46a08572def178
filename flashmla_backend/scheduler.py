"""Python mirror of the tile-scheduler kernel (csrc/smxx/tile_scheduler.cu).

It produces the same int32 metadata bit for bit (the GPU tests compare them) and serves CPU tensors.
The model, in short (the kernel's header comment has the full statement; the timings behind each choice
are in docs/perf/journal.md):
  request i costs w_i = ceil(len_i / PAGE_SIZE) + FIXED_OVERHEAD_BLOCKS units (geometry: PAGE_SIZE, BLOCK_M,
  META_INTS); requests are laid end to end, request i on [C_i, C_i + w_i); part p starts at unit p * P,
  P = max(M, ceil((T - FIXED_OVERHEAD_BLOCKS) / num_sm_parts)), M = min_part_blocks (MIN_PART_BLOCKS, or
  SPARSE_MIN_PART_BLOCKS for the sparse kernel's schedules): the last request's trailing
  overhead needs no part of its own (the last part always runs to the end of the batch), so b = 1 with 128
  blocks on 66 parts gets P = 2 (64 parts of 2 blocks), not ceil(133 / 66) = 3 (43 parts of 3 blocks).
  Unit C_i + k is the position (i, k) when k < nb_i or k == 0 (a request's first unit is its start, even
  for a zero-length request); inside the rest of its overhead it is (i + 1, 0).
  Part p covers the positions from its start to the next part's start.
Piece mode (batch <= min(num_sm_parts, PIECE_MODE_MAX_BATCH)): each part computes at most one piece of one
request. Request i is cut into s_i = max(1, ceil(nb_i / G)) nearly equal pieces (q, r = divmod(nb_i, s_i);
piece j: blocks [j q + min(j, r), (j + 1) q + min(j + 1, r))), G the smallest grain in [M, P]
with sum s_i <= num_sm_parts (if G = P does not fit, the line model is used); pieces go to parts in order (request by
request), the remaining parts are empty. A piece has at most G <= P blocks, so no part costs more than the
line model's bound (P + overhead), and no request that fits in one part is cut: 128 requests of 128 blocks
on 132 parts are 128 whole requests (no combine), where the line model cut 127 of them in two.
Whole-request mode (when piece mode does not apply): request i goes whole to part q_i = min(floor(C_i / P),
num_sm_parts - 1), the part in which it starts; a part's cost is C(end of its last request) - C(start of its first).
Used when the largest part costs at most WHOLE_SLACK_PERCENT % more than the line model's bound P + overhead: no
request is cut, so no combine runs (128 requests of 128 blocks on 66 parts: two whole requests per part, 266
units against the line model's 263, which cut 63 requests).
Metadata row p: [begin_req, begin_token, end_req (inclusive), end_token (exclusive), begin_split, 0, 0, 0].
"""
from __future__ import annotations

import torch

from .geometry import BLOCK_M, META_INTS, PAGE_SIZE

FIXED_OVERHEAD_BLOCKS = 5
MIN_PART_BLOCKS = 2   # P and piece mode's grain are at least this (csrc/params.h: kMinPartBlocks says why)
SPARSE_MIN_PART_BLOCKS = 1   # the sparse kernel's schedules (csrc/params.h: kSparseMinPartBlocks)
PIECE_MODE_MAX_BATCH = 256
WHOLE_SLACK_PERCENT = 3


def num_sm_parts(sm_count: int, num_heads_k: int, num_q_tokens_per_head_k: int) -> int:
    """Persistent CTA columns: one CTA per (part, m-tile of BLOCK_M query rows, kv head) fills the GPU."""
    m_tiles = -(-num_q_tokens_per_head_k // BLOCK_M)
    return max(1, sm_count // num_heads_k // m_tiles)


def sparse_num_sm_parts(sm_count: int, rows: int, topk: int, num_heads_q: int) -> int:
    """Parts of the sparse kernel's schedule (rows of topk entries, one latent KV head): num_sm_parts, but no more than
    the rows' blocks. With one-block pieces (SPARSE_MIN_PART_BLOCKS) every block gets a part of its own once there are
    as many parts as blocks, so more parts schedule the same pieces and only add CTAs that return at once (H200, b = 1
    top-k 512: 8 one-block pieces on 66 parts 21.3-21.8 us, on 8 parts 20.3-20.6; docs/perf/journal.md, 2026-12-03)."""
    blocks = rows * -(-topk // PAGE_SIZE)
    return max(1, min(num_sm_parts(sm_count, 1, num_heads_q), blocks))


def schedule(cache_seqlens: torch.Tensor, num_parts: int,
             min_part_blocks: int = MIN_PART_BLOCKS) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tile_scheduler_metadata [num_parts, 8] int32, num_splits [b + 1] int32) on the CPU; min_part_blocks:
    the smallest P and piece grain (MIN_PART_BLOCKS, or SPARSE_MIN_PART_BLOCKS for the sparse kernel)."""
    lengths = [max(int(v), 0) for v in cache_seqlens.tolist()]
    b = len(lengths)
    meta = torch.zeros((num_parts, META_INTS), dtype=torch.int32)
    num_splits = torch.zeros((b + 1,), dtype=torch.int32)
    if b == 0:
        meta[:, 2] = -1  # every part empty: begin_req 0 > end_req -1
        return meta, num_splits

    blocks = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in lengths]
    starts = []  # C_i
    total = 0
    for nb in blocks:
        starts.append(total)
        total += nb + FIXED_OVERHEAD_BLOCKS
    per_part = max(min_part_blocks, -(-(total - FIXED_OVERHEAD_BLOCKS) // num_parts))

    pieces = _piece_mode_split_counts(blocks, num_parts, per_part, min_part_blocks)
    if pieces is not None:
        part = 0
        for i, (nb, s) in enumerate(zip(blocks, pieces)):
            q, r = divmod(nb, s)  # piece j: blocks [j q + min(j, r), (j + 1) q + min(j + 1, r))
            for j in range(s):
                end_token = lengths[i] if j == s - 1 else ((j + 1) * q + min(j + 1, r)) * PAGE_SIZE
                meta[part, :5] = torch.tensor([i, (j * q + min(j, r)) * PAGE_SIZE, i, end_token, j], dtype=torch.int32)
                part += 1
            num_splits[i + 1] = part
        _empty_rows(meta[part:], lengths)
        return meta, num_splits

    whole = _whole_mode_parts(starts, blocks, per_part, num_parts)
    if whole is not None:
        _empty_rows(meta, lengths)  # rows of parts that get no request stay so
        for i, q in enumerate(whole):
            if i == 0 or whole[i - 1] != q:
                meta[q, 0], meta[q, 1], meta[q, 4] = i, 0, 0
            if i == b - 1 or whole[i + 1] != q:
                meta[q, 2], meta[q, 3] = i, lengths[i]
        num_splits[:] = torch.arange(b + 1, dtype=torch.int32)
        return meta, num_splits

    def position(unit: int) -> tuple[int, int]:
        """(request, block) where the part starting at `unit` begins; (b, 0) at or past the end."""
        if unit >= total:
            return b, 0
        # last request whose start is <= unit (binary search over C)
        lo, hi = 0, b - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if starts[mid] <= unit:
                lo = mid
            else:
                hi = mid - 1
        off = unit - starts[lo]
        return (lo, off) if off < blocks[lo] or off == 0 else (lo + 1, 0)

    begins = [position(p * per_part) for p in range(num_parts)] + [(b, 0)]
    cuts = [0] * b
    for p in range(num_parts):
        req, block = begins[p]
        split = 0
        if block > 0:
            cuts[req] += 1
            split = cuts[req]
        end_req, end_block = begins[p + 1]
        if end_block > 0:
            end = (end_req, end_block * PAGE_SIZE)
        else:
            end = (end_req - 1, lengths[end_req - 1] if end_req > 0 else 0)
        meta[p, :5] = torch.tensor([req, block * PAGE_SIZE, end[0], end[1], split], dtype=torch.int32)
    running = 0
    for i in range(b):
        running += 1 + cuts[i]
        num_splits[i + 1] = running
    return meta, num_splits


def _empty_rows(rows: torch.Tensor, lengths: list[int]) -> None:
    """Marks metadata rows (zero-filled) empty as the kernel's write_empty_row does: begin_req b > end_req b - 1,
    whose end token is the last request's length."""
    rows[:, 0] = len(lengths)
    rows[:, 2] = len(lengths) - 1
    rows[:, 3] = lengths[-1]


def _whole_mode_parts(starts: list[int], blocks: list[int], per_part: int, num_parts: int) -> list[int] | None:
    """Part of each request in whole-request mode (module docstring), or None when its largest part is too costly."""
    parts = [min(c // per_part, num_parts - 1) for c in starts]
    largest, begin = 0, 0
    for i, (c, q) in enumerate(zip(starts, parts)):
        if i == 0 or parts[i - 1] != q:
            begin = c
        largest = max(largest, c + blocks[i] + FIXED_OVERHEAD_BLOCKS - begin)
    if largest * 100 > (per_part + FIXED_OVERHEAD_BLOCKS) * (100 + WHOLE_SLACK_PERCENT):
        return None
    return parts


def _piece_mode_split_counts(blocks: list[int], num_parts: int, per_part: int,
                             min_part_blocks: int) -> list[int] | None:
    """Split counts s_i of piece mode (module docstring), or None when the line model is to be used."""
    if len(blocks) > min(num_parts, PIECE_MODE_MAX_BATCH):
        return None

    def pieces(nb: int, grain: int) -> int:
        return max(1, -(-nb // grain))

    def count(grain: int) -> int:
        return sum(pieces(nb, grain) for nb in blocks)

    if count(per_part) > num_parts:
        return None
    # smallest grain whose piece count fits; none below ceil(sum(blocks) / num_parts) can (count >= sum / grain)
    lo, hi = max(min_part_blocks, min(per_part, -(-sum(blocks) // num_parts))), per_part
    while lo < hi:
        mid = (lo + hi) // 2
        if count(mid) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    return [pieces(nb, lo) for nb in blocks]
