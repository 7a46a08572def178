#!/usr/bin/env python3
"""Python model of the sm90 sparse decode kernel's barrier protocol (kernel.cuh, lead.cuh, common.cuh).

A mirror of the order of waits, arrivals, reads and writes of the gather warps (common.cuh: gather_warp), the
transposer warps (common.cuh: transpose_warp, with block_group_factors) and the two consumer warpgroups (lead.cuh:
lead_loop / follow_loop, follow_group); the arrival counts are those of lead.cuh and common.cuh (read from the files),
so a change there is checked as it is. It is not a test of the compiled code: keep the agents below in step with those
files when the schedule changes. Run by tests/test_device_checks.py; `python3 protocol_model.py` prints the verdict.

The simulator (mbarrier phases with the hardware's parity rule, named barriers, and the data checks: a buffer is
rewritten only after every reader of its previous contents finished, a reader reads the block it expects) is the
dense FP8 kernel's model (decode_fp8/checks/protocol_model.py), imported from there. Checked over random
interleavings of row pieces of 0..9 blocks, one role starved in turn: no deadlock, no parity wait two phases ahead or
a phase missed, no stale read or early rewrite of a stage (each gather warp writes its half), a V^T half (half 0 is
read by warpgroup 0's P V of group 0, which completes under the next block's Q K^T, and by warpgroup 1's of group 1;
half 1 by warpgroup 1's of groups 2 and 3: two readers each, one vt_empty arrival a warp and group), a block's group
factors (transposer warp w writes those of groups 2 w, 2 w + 1: warp 0's are read by both warpgroups, warp 1's by
warpgroup 1; no barrier of their own, the stage's vt_full publishes them and its empty frees them), a P slot (read
by warpgroup 1 until its last group's words), the rows' sums (written by warpgroup 0 with a row piece's last P,
read by warpgroup 1 between that slot's p_full and p_empty) or the Q tile (warpgroup 0 its only reader; warpgroup 1
writes half of the CTA's first one only, behind a named barrier that warpgroup 0 alone waits on).
Warpgroup 1 does not hold the stage (no arrival on its empty barrier): the factors and pairs it reads until group 3's
words are rewritten for block g + 2 only after the transposer warps' half 1 of block g + 1, which waited for
warpgroup 1's group 3 P V of block g; the model reads them that long and finds no early rewrite.
What the model showed: warpgroup 0's wait for a free P slot (p_empty) was implied by the stage ring while warpgroup 1
held the stage (its Q K^T of block g needed stage g, gathered once warpgroup 1 released stage g - 2 with P of g - 2);
now nothing else holds warpgroup 0 back, and the model catches the wait's removal ("p slot rewritten early").
Warpgroup 1 waits, before its group 1 P V of block g, for warpgroup 0's arrival that follows the issue of its next
tensor work (the next block's Q K^T, or at once at a row piece's last block), on qk_issued[g % 2] (lead.cuh); the
model checks the parity waits and catches a missing arrival at a row piece's last block (a deadlock). With a single
barrier it found warpgroup 0 two phases ahead of the wait when V^T half 0 had a ring of two slots (a schedule
measured and dropped): a parity wait passing on the wrong phase; with today's one slot a single barrier holds
(tests/test_device_checks.py plays it as a mutation).
"""
from __future__ import annotations

import importlib.util
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPARSE = HERE.parent
_DENSE = SPARSE.parent / "decode_fp8" / "checks" / "protocol_model.py"
_spec = importlib.util.spec_from_file_location("decode_fp8_protocol_model", _DENSE)
_dense = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_dense)
ProtocolError = _dense.ProtocolError
Sim = _dense.Sim

STAGES = 2
CONSUMER_WARPS = 4


def _constant(text: str, name: str) -> str:
    m = re.search(rf"constexpr (?:int|uint32_t) {name} = ([^;]+);", text)
    if not m:
        raise ProtocolError(f"{name} not found")
    return m.group(1)


def read_counts() -> dict[str, int]:
    """The arrival counts of the kernel's mbarriers, from its headers (kTransposeWarps substituted)."""
    common = (SPARSE / "common.cuh").read_text()
    lead = (SPARSE / "lead.cuh").read_text()
    env = {"kTransposeWarps": int(_constant(common, "kTransposeWarps")),
           "kGatherWarps": int(_constant(common, "kGatherWarps")),
           "kGroupsPerVtHalf": int(_constant(common, "kGroupsPerVtHalf"))}
    ev = lambda expr: int(eval(expr, {}, dict(env)))  # noqa: E731, S307 (constant expressions of the headers)
    return {"warps": env["kTransposeWarps"], "gather_warps": env["kGatherWarps"],
            "full": ev(_constant(common, "kFullArrivals")) // 33,   # a warp's 33 arrivals counted as one
            "vt_full": ev(_constant(common, "kVtFullArrivals")), "vt_empty": ev(_constant(common, "kVtEmptyArrivals")),
            "lead_empty": ev(_constant(lead, "kLeadEmptyArrivals")),
            "p_slot": ev(_constant(lead, "kPSlotArrivals")), "qk_issued": ev(_constant(lead, "kQkIssuedArrivals")),
            "stages": int(_constant(common, "kStages")), "p_slots": int(_constant(lead, "kPSlots"))}


# ---- producer agents ---------------------------------------------------------------------------------------------
def gather_agent(w: int, blocks: int):
    """Gather warp w: half w of every block, ("stage", s, w); a reader of ("stage", s) reads every half (run)."""
    for g in range(blocks):
        s = g % STAGES
        if g >= STAGES:
            yield ("wait", "empty", s, g // STAGES - 1)
        yield ("write", ("stage", s, w), g, "stage")
        yield ("arrive", "full", s)   # the warp's 33 arrivals on full[s] as one: they all follow its copies


def transposer_agent(w: int, blocks: int, mutation=None):
    for g in range(blocks):
        s = g % STAGES
        yield ("wait", "full", s, g // STAGES)
        yield ("read_begin", ("stage", s), g)
        yield ("write", ("fac", s, w), g, f"fac{w}")   # the factors of groups 2 w, 2 w + 1 (block_group_factors)
        for h in (0, 1):                        # V^T half h of block g in slot h
            if g > 0 and mutation != "transposer ignores vt_empty":
                yield ("wait", "vt_empty", h, g - 1)
            yield ("write", ("vt", h), g, "vt")
            yield ("arrive", "vt_full", h)
        yield ("read_end", ("stage", s), g)
        yield ("arrive", "empty", s)


def warps_arrive(bar: str, i: int):
    for _ in range(CONSUMER_WARPS):
        yield ("arrive", bar, i)


def factors_and_vt(wg: int, g: int, mutation=None):
    """The consumer's wait for V^T half 0 of block g, which also publishes the block's group factors, read then
    (warpgroup 0: group 0's, of transposer warp 0; warpgroup 1: groups 1..3, of both transposer warps)."""
    s = g % STAGES
    if mutation != "factors read before vt_full":
        yield ("wait", "vt_full", 0, g)
    for w in ((0,) if wg == 0 else (0, 1)):
        yield ("read_begin", ("fac", s, w), g)
    if wg == 0:
        yield ("read_end", ("fac", s, 0), g)   # group 0's factor and pairs: its words follow at once
    if mutation == "factors read before vt_full":
        yield ("wait", "vt_full", 0, g)


def pv_group(slot: int, g: int):
    """A group's P V of the V^T half of block g in `slot`, waited for, then the half's release (one arrival a
    warp)."""
    yield ("read_begin", ("vt", slot), g)
    yield ("read_end", ("vt", slot), g)
    yield from warps_arrive("vt_empty", slot)


# ---- the consumer warpgroups (lead.cuh: lead_loop, follow_loop) ---------------------------------------------------
def qk_phase(g: int, mutation) -> tuple[int, int]:
    """Block g's phase of qk_issued, (barrier, completion): two barriers by turns (lead.cuh), or the one of an
    earlier version (a mutation)."""
    return (0, g) if mutation == "one qk_issued barrier" else (g % 2, g // 2)


def lead_qk(g: int, row: int):
    s = g % STAGES
    yield ("wait", "full", s, g // STAGES)
    for half in (0, 1):                     # the Q tile's heads 0..31 and 32..63, read by the product alone
        yield ("read_begin", ("q", half), row)
        yield ("read_end", ("q", half), row)
    yield ("read_begin", ("stage", s), g)   # Q K^T, then the mask and the scales, until the words


def lead_consumer(rows: list[int], p_slots: int, mutation=None, seed: int = 0):
    """lead.cuh's order: block g + 1's first two group products issued (so its stage waited for and read) before
    block g's softmax, P and words where block g + 1 has landed, else after the words; either way before block g's
    P V of group 0, and block g's phase of qk_issued once block g + 1's last two products are issued after that P V.
    The kernel takes the early place only where the stage's phase has completed; here it is chosen at random a block,
    and the wait may block there (a superset of the kernel's interleavings)."""
    pick = random.Random(seed + 7919)
    g = 0
    yield ("write", ("q", 0), 0, "q")               # the first row piece's Q tile: this warpgroup's heads,
    yield ("both_arrive", "first_q")                # then a wait for warpgroup 1's (kBarFirstQ)
    if mutation != "first q half read before it was written":
        yield ("both_wait", "first_q")
    for row, n in enumerate(rows):
        if n:
            yield from lead_qk(g, row)
        for blk in range(n):
            s, c = g % STAGES, g % p_slots
            if blk + 1 == n and row + 1 < len(rows):   # the row piece's last Q K^T done: the next Q tile's copy
                yield ("write", ("q", 0), row + 1, "q")
                yield ("write", ("q", 1), row + 1, "q")
            early = pick.random() < 0.5
            if early and blk + 1 < n:
                yield from lead_qk(g + 1, row)      # its products begin under this block's softmax
            if g >= p_slots and mutation != "p slot rewritten early":
                yield ("wait", "p_empty", c, g // p_slots - 1)
            yield ("write", ("p16", c), g, "one")   # P and the rows' factor
            if blk + 1 == n:
                yield ("write", ("rsum", c), g, "one")   # the rows' sums, with the row piece's last P
            yield from warps_arrive("p_full", c)
            yield from factors_and_vt(0, g, mutation)
            yield ("read_end", ("stage", s), g)
            yield from warps_arrive("empty", s)
            if not early and blk + 1 < n:
                yield from lead_qk(g + 1, row)      # the stage had not landed: its products after the words
            # P V of group 0, issued after the next block's first products and released after its last issue
            yield ("read_begin", ("vt", 0), g)
            if blk + 1 < n:
                yield from warps_arrive("qk_issued", qk_phase(g, mutation)[0])   # the next Q K^T issued
            elif mutation != "qk_issued missing at a row piece's last block":
                yield from warps_arrive("qk_issued", qk_phase(g, mutation)[0])
            if mutation == "half 0 released before its P V":
                yield from warps_arrive("vt_empty", 0)
                yield ("read_end", ("vt", 0), g)
            else:
                yield ("read_end", ("vt", 0), g)
                yield from warps_arrive("vt_empty", 0)
            g += 1
        if row + 1 < len(rows) and n == 0:          # the next row piece's Q tile, this warpgroup alone
            yield ("write", ("q", 0), row + 1, "q")
            yield ("write", ("q", 1), row + 1, "q")


def follow_consumer(rows: list[int], p_slots: int, mutation=None):
    g = 0
    yield ("write", ("q", 1), 0, "q")               # heads 32..63 of the first Q tile, and no wait
    yield ("both_arrive", "first_q")
    for row, n in enumerate(rows):
        for blk in range(n):
            s, c = g % STAGES, g % p_slots
            last = blk + 1 == n
            if last and mutation == "row sums read early":
                yield ("read_begin", ("rsum", c), g)
                yield ("read_end", ("rsum", c), g)
            yield ("wait", "p_full", c, g // p_slots)
            yield ("read_begin", ("p16", c), g)     # the rows' factor now, P by chunks until group 3's words
            if last and mutation != "row sums read early":
                yield ("read_begin", ("rsum", c), g)   # the rows' sums of the row piece
                yield ("read_end", ("rsum", c), g)
            yield from factors_and_vt(1, g, mutation)   # the factors and pairs of groups 1..3, until their words
            yield ("read_end", ("fac", s, 0), g)     # group 1's words
            yield ("wait", "qk_issued", *qk_phase(g, mutation))
            yield from pv_group(0, g)               # group 1
            if mutation != "half 1 read before vt_full":
                yield ("wait", "vt_full", 1, g)
            yield from pv_group(1, g)               # group 2
            if mutation != "pairs read after their half's release":
                yield ("read_end", ("fac", s, 1), g)     # group 3's words (group 2's pairs read before its P V)
            yield ("read_end", ("p16", c), g)
            yield from warps_arrive("p_empty", c)
            yield from pv_group(1, g)               # group 3
            if mutation == "pairs read after their half's release":
                yield ("read_end", ("fac", s, 1), g)
            g += 1


def run(rows: list[int], counts: dict[str, int] | None = None, seed: int = 0, mutation=None,
        starve: str | None = None) -> None:
    """One random interleaving of the CTA's agents over row pieces with these block counts."""
    counts = read_counts() if counts is None else counts
    sim = Sim(STAGES, {"kKvEmptyArrivals": 1, "kVtFullArrivals": 1, "kVtEmptyArrivals": 1})
    sim.count = {"full": counts["full"], "empty": counts["lead_empty"], "vt_full": counts["vt_full"],
                 "vt_empty": counts["vt_empty"], "p_full": counts["p_slot"], "p_empty": counts["p_slot"],
                 "qk_issued": counts["qk_issued"]}
    blocks = sum(rows)
    agents = {f"gather{w}": gather_agent(w, blocks) for w in range(counts["gather_warps"])}
    for w in range(counts["warps"]):
        agents[f"transposer{w}"] = transposer_agent(w, blocks, mutation)
    agents["wg0"] = lead_consumer(rows, counts["p_slots"], mutation, seed)
    agents["wg1"] = follow_consumer(rows, counts["p_slots"], mutation)
    # Readers a buffer's contents must have had before it is rewritten. The transposer warps and warpgroup 0 read a
    # stage (warpgroup 1 reads only what the transposer warps made of it); a V^T half has two group readers; transposer
    # warp 0's factors are read by both warpgroups, warp 1's by warpgroup 1.
    # The Q tile is rewritten by its one reader (warpgroup 0) in program order; a row piece without blocks never
    # reads it, so its writes check only for reads in progress and the reads for the row they expect.
    readers = {"stage": counts["warps"] + 1, "vt": 2, "fac0": 2, "fac1": 1, "one": 1, "q": 0}
    both = {"first_q"}   # named barriers of both warpgroups
    gen = {(b, w): 0 for b in both for w in ("wg0", "wg1")}

    def ready(name, op) -> bool:
        kind = op[0]
        if kind == "wait":
            return sim.can_wait(op[1], op[2], op[3], name)
        if kind == "both_wait":
            other = "wg1" if name == "wg0" else "wg0"
            return gen[(op[1], other)] >= gen[(op[1], name)]
        return True

    def execute(name, op) -> None:
        if op[0] in ("read_begin", "read_end") and op[1][0] == "stage":   # a stage's reader reads both halves
            for w in range(counts["gather_warps"]):
                sim.apply((op[0], ("stage", op[1][1], w), op[2]), readers, name)
            return
        if sim.apply(op, readers, name):
            return
        if op[0] == "both_arrive":
            gen[(op[1], name)] += 1

    _dense.interleave(agents, ready, execute, seed, starve, f"rows {rows}")


def check_all(seeds: int = 20) -> int:
    """Row sequences of 0..9 blocks; returns the number of runs."""
    counts = read_counts()
    gen = random.Random(3)
    sequences = [[n] for n in range(10)] + [[a, b] for a in range(5) for b in range(5)]
    sequences += [[gen.randrange(0, 10) for _ in range(gen.randrange(1, 5))] for _ in range(15)]
    starved = [None, "wg0", "wg1"] + [f"gather{w}" for w in range(counts["gather_warps"])]
    starved += [f"transposer{w}" for w in range(counts["warps"])]
    runs = 0
    for rows in sequences:
        for seed in range(seeds):
            run(rows, counts, seed=seed, starve=starved[seed % len(starved)])
            runs += 1
    return runs


if __name__ == "__main__":
    try:
        n = check_all()
    except ProtocolError as e:
        print(f"sparse protocol model: INCONSISTENT: {e}")
        sys.exit(1)
    print(f"sparse protocol model: consistent ({n} interleavings)")
