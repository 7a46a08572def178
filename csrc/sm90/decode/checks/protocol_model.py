#!/usr/bin/env python3
"""Python model of the sm90 decode kernel's KV load / mbarrier-wait protocol.

A mirror of the control flow of mainloop.cuh (run_steps(), the pieces each warpgroup waits for and in which
order), copies.cuh (issue_request_loads, refill_kv_pieces) and the refill masks, which are read from config.h
(kRefillMask), so a change of the masks is checked as it is. It is not a test of the compiled code: keep
steps() and the wait orders below in step with mainloop.cuh when the schedule changes. Run by
tests/test_device_checks.py; `python3 protocol_model.py` prints the verdict.

For sequences of requests with arbitrary block counts it checks that
  - every block is loaded exactly once per piece, into stage b % 2, and waited for exactly once per piece;
  - the parity a warpgroup waits with equals the number of completed phases of that barrier mod 2;
  - a piece is refilled only after the previous block in that stage and piece was consumed (its last reader
    finished), and no phase is ever more than one ahead of its waiter;
  - nothing is left in flight at the end of a request (the next request's loads reuse the barriers).
"""
from __future__ import annotations

import itertools
import random
import re
import sys
from pathlib import Path

CONFIG_H = Path(__file__).resolve().parents[1] / "config.h"
NUM_PIECES = 9
PIECES = range(NUM_PIECES)

# Pieces each warpgroup waits for before its Q K^T of a block (mainloop.cuh: qk_pieces calls), in order.
WG0_FIRST_WAIT = [list(PIECES)]                 # block 0: all nine in one chain
WG0_NEXT_WAIT = [[0, 1, 2, 3], [4, 5, 6, 7, 8]]  # blocks b0 + 2: two chains around the stage-1 refill
WG1_WAIT = [[4, 5, 6, 7, 0, 1, 2, 3, 8]]         # block 1 and blocks b0 + 3


class ProtocolError(AssertionError):
    """A load or wait sequence the kernel would get wrong (hang, stale data, or a barrier phase skipped)."""


def read_refill_masks(config_h: Path = CONFIG_H) -> dict[tuple[int, int], int]:
    """kRefillMask[stage][warpgroup] of config.h as {(stage, warpgroup): mask}."""
    text = config_h.read_text()
    m = re.search(r"kRefillMask\[kNumStages\]\[kNumWarpGroups\]\s*=\s*\{(.*?)\};", text, re.S)
    if not m:
        raise ProtocolError(f"kRefillMask not found in {config_h}")
    rows = re.findall(r"\{([^{}]*)\}", m.group(1))
    masks = [[int(v.strip().rstrip("uU"), 0) for v in row.split(",") if v.strip()] for row in rows]
    if len(masks) != 2 or any(len(r) != 2 for r in masks):
        raise ProtocolError(f"kRefillMask in {config_h} is not 2 x 2: {masks}")
    return {(s, wg): masks[s][wg] for s in (0, 1) for wg in (0, 1)}


def steps(nblk: int) -> list[tuple[bool, bool, bool, int]]:
    """run_steps() of mainloop.cuh: (has1, next0, next1, b0) per step."""
    out = []
    b0 = 0
    while b0 + 4 <= nblk:
        out.append((True, True, True, b0))
        b0 += 2
    rem = nblk - b0
    if rem == 3:
        out += [(True, True, False, b0), (False, False, False, b0 + 2)]
    elif rem == 2:
        out.append((True, False, False, b0))
    elif rem == 1:
        out.append((False, False, False, b0))
    return out


def run(requests: list[int], refill: dict[tuple[int, int], int] | None = None, steps_fn=steps) -> None:
    """Plays the loads and waits of one CTA over requests with the given block counts; raises ProtocolError."""
    refill = read_refill_masks() if refill is None else refill

    def expect(cond: bool, msg: str) -> None:
        if not cond:
            raise ProtocolError(msg)

    keys = [(s, j) for s in (0, 1) for j in PIECES]
    completed = {k: 0 for k in keys}       # completed phases per (stage, piece) barrier
    pending = {k: None for k in keys}      # (request, block) loaded and not yet consumed
    last_consumed = {k: None for k in keys}
    parity = [0, 0]                        # warpgroup s waits on stage s

    def load(s, j, blk, req):
        expect(pending[(s, j)] is None, f"request {req}: second load in flight on stage {s} piece {j}")
        expect(blk % 2 == s, f"request {req}: block {blk} loaded into stage {s}")
        if blk >= 2:
            expect(last_consumed[(s, j)] == (req, blk - 2),
                   f"request {req}: refill of block {blk} before block {blk - 2} was consumed (stage {s} piece {j})")
        pending[(s, j)] = (req, blk)
        completed[(s, j)] += 1  # the TMA completes eventually: modelled as at once

    def wait(s, pieces, blk, req):
        for j in pieces:
            expect(pending[(s, j)] == (req, blk),
                   f"request {req}: wait for block {blk} but stage {s} piece {j} holds {pending[(s, j)]}")
            # try_wait.parity(P) returns once the phase with parity P completed: an odd number of completed
            # phases for P = 0, even for P = 1, and no further phase may have completed.
            expect(completed[(s, j)] % 2 == (parity[s] + 1) % 2,
                   f"request {req}: parity mismatch on stage {s} piece {j} waiting for block {blk}")

    def consume(s, blk, req):
        for j in PIECES:
            pending[(s, j)] = None
            last_consumed[(s, j)] = (req, blk)

    def mask(m):
        return [j for j in PIECES if (m >> j) & 1]

    for req, nblk in enumerate(requests):
        # issue_request_loads, after the previous request's __syncthreads
        for k, v in pending.items():
            expect(v is None, f"request {req}: load {v} of stage/piece {k} left over from the previous request")
        last_consumed = {k: None for k in keys}
        if nblk > 0:
            for j in PIECES:
                load(0, j, 0, req)
        if nblk > 1:
            for j in PIECES:
                load(1, j, 1, req)
        if nblk == 0:
            continue
        # prologues: WG0 waits for block 0, WG1 for block 1
        for chain in WG0_FIRST_WAIT:
            wait(0, chain, 0, req)
        parity[0] ^= 1
        if nblk > 1:
            for chain in WG1_WAIT:
                wait(1, chain, 1, req)
            parity[1] ^= 1
        # The two warpgroups interleave; the named barriers order the events as played here.
        for has1, next0, next1, b0 in steps_fn(nblk):
            expect(has1 == (b0 + 1 < nblk) and next0 == (b0 + 2 < nblk) and next1 == (b0 + 3 < nblk),
                   f"request {req}: step at block {b0} of {nblk} specialized as {(has1, next0, next1)}")
            # WG0 after P0 V0L refills stage 0's left pieces, WG1 after P0 V0R the rest (its P0 is in piece 8)
            consume(0, b0, req)
            if next0:
                for wg in (0, 1):
                    for j in mask(refill[(0, wg)]):
                        load(0, j, b0 + 2, req)
            if has1:
                consume(1, b0 + 1, req)
                if next1:
                    for wg in (1, 0):  # WG1 after P1 V1R, WG0 after P1 V1L
                        for j in mask(refill[(1, wg)]):
                            load(1, j, b0 + 3, req)
            if next0:
                for chain in WG0_NEXT_WAIT:
                    wait(0, chain, b0 + 2, req)
                parity[0] ^= 1
            if next1:
                for chain in WG1_WAIT:
                    wait(1, chain, b0 + 3, req)
                parity[1] ^= 1
        for k, v in pending.items():
            expect(v is None, f"request {req}: load {v} of stage/piece {k} never consumed")


def request_sequences(seed: int = 0):
    """Single requests of 0..39 blocks, all triples of 0..6 blocks, and random mixes with long requests."""
    for n in range(40):
        yield [n]
    for seq in itertools.product(range(7), repeat=3):
        yield list(seq)
    rng = random.Random(seed)
    for _ in range(2000):
        yield [rng.choice([0, 1, 2, 3, 4, 5, 64, 65, 127]) for _ in range(rng.randint(1, 8))]


def check(refill: dict[tuple[int, int], int] | None = None, steps_fn=steps) -> int:
    """Runs every request sequence; returns how many were checked (raises ProtocolError on the first failure)."""
    refill = read_refill_masks() if refill is None else refill
    n = 0
    for seq in request_sequences():
        run(seq, refill, steps_fn)
        n += 1
    return n


def main() -> int:
    try:
        n = check()
    except ProtocolError as e:
        print(f"protocol model: FAILED: {e}")
        return 1
    print(f"protocol model: all {n} request sequences consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
