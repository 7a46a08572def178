#!/usr/bin/env python3
"""Python model of the sm90 sparse decode kernel's barrier protocol, both plans (split.cuh, seesaw.cuh).

A mirror of the order of waits, arrivals, reads and writes of the gather warp (split_gather_warp /
seesaw_gather_warp), the three transposer warps (common.cuh: transpose_warp) and the two consumer warpgroups
(split_consumer_loop / seesaw_consumer_loop); the arrival counts are those of split.cuh, seesaw.cuh and common.cuh
(read from the files), so a change there is checked as it is. It is not a test of the compiled code: keep the agents
below in step with those files when the schedule changes. Run by tests/test_device_checks.py; `python3
protocol_model.py` prints the verdict.

The simulator (mbarrier phases with the hardware's parity rule, named barriers, and the data checks: a buffer is
rewritten only after every reader of its previous contents finished, a reader reads the block it expects) is the
dense FP8 kernel's model (decode_fp8/checks/protocol_model.py), imported from there. Checked over random
interleavings of row pieces of 0..9 blocks, one role starved in turn: no deadlock, no parity wait two phases ahead or
a phase missed, no stale read or early rewrite of a stage, a scale slot, a V^T half, a score part (split) or a P
hand-off and the row statistics (seesaw), and the named barriers' arrivals and waits equal at the end.
What the model showed about the seesaw plan: its scale slots' sc_empty barrier is implied by the V^T chain (the
gather of block g needs stage g - 2 released, which needs the transposition of g - 2, which waits for warpgroup 1's
P V of g - 3, after it built its words of g - 4 from the slot), so removing that wait breaks nothing with one V^T
slot a half and two stages; it stays, for other ring and stage counts.
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
SCALE_SLOTS = 4
CONSUMER_WARPS = 4


def _constant(text: str, name: str) -> str:
    m = re.search(rf"constexpr (?:int|uint32_t) {name} = ([^;]+);", text)
    if not m:
        raise ProtocolError(f"{name} not found")
    return m.group(1)


def read_counts() -> dict[str, int]:
    """The arrival counts of the kernel's mbarriers, from its headers (kTransposeWarps substituted)."""
    common = (SPARSE / "common.cuh").read_text()
    split = (SPARSE / "split.cuh").read_text()
    seesaw = (SPARSE / "seesaw.cuh").read_text()
    env = {"kTransposeWarps": int(_constant(common, "kTransposeWarps"))}
    ev = lambda expr: int(eval(expr, {}, dict(env)))  # noqa: E731, S307 (constant expressions of the headers)
    return {"warps": env["kTransposeWarps"],
            "vt_full": ev(_constant(common, "kVtFullArrivals")), "vt_empty": ev(_constant(common, "kVtEmptyArrivals")),
            "split_empty": ev(_constant(split, "kSplitEmptyArrivals")),
            "seesaw_empty": ev(_constant(seesaw, "kSeesawEmptyArrivals")),
            "sc_empty": ev(_constant(seesaw, "kScaleEmptyArrivals")),
            "stages": int(_constant(common, "kStages")), "slots": int(_constant(seesaw, "kScaleSlots"))}


def padded(n: int, seesaw: bool) -> int:
    return (n + 1) & ~1 if seesaw else n


# ---- producer agents ---------------------------------------------------------------------------------------------
def gather_agent(blocks: int, seesaw: bool, slots: int, mutation=None):
    for g in range(blocks):
        s = g % STAGES
        if g >= STAGES:
            yield ("wait", "empty", s, g // STAGES - 1)
        if seesaw and g >= slots and mutation != "gather ignores sc_empty":
            yield ("wait", "sc_empty", g % slots, g // slots - 1)
        yield ("write", ("stage", s), g, "stage")
        if seesaw:
            yield ("write", ("scales", g % slots), g, "scales")
        yield ("arrive", "full", s)   # the 33 arrivals of full[s] as one: they all follow the copies


def transposer_agent(blocks: int, mutation=None):
    for g in range(blocks):
        s = g % STAGES
        yield ("wait", "full", s, g // STAGES)
        for h in (0, 1):
            if g > 0 and mutation != "transposer ignores vt_empty":
                yield ("wait", "vt_empty", h, g - 1)
            yield ("read_begin", ("stage", s), g)
            yield ("write", ("vt", h), g, "vt")
            yield ("read_end", ("stage", s), g)
            yield ("arrive", "vt_full", h)
        yield ("arrive", "empty", s)


def rendezvous(bar: str):
    """A named barrier that both consumer warpgroups sync on: this warpgroup's arrival, then its wait for the
    other's arrival at the same generation."""
    yield ("both_arrive", bar)
    yield ("both_wait", bar)


def warps_arrive(bar: str, i: int):
    for _ in range(CONSUMER_WARPS):
        yield ("arrive", bar, i)


def pv(wg: int, g: int):
    yield ("wait", "vt_full", wg, g)
    yield ("read_begin", ("vt", wg), g)
    yield ("read_end", ("vt", wg), g)
    yield from warps_arrive("vt_empty", wg)


# ---- the split plan (split.cuh: split_consumer_loop) -------------------------------------------------------------
def split_consumer(wg: int, rows: list[int], mutation=None):
    g = 0
    for n in rows:
        yield from rendezvous("consumers")          # the Q tile written
        for _ in range(n):
            s = g % STAGES
            yield ("wait", "full", s, g // STAGES)
            yield ("read_begin", ("stage", s), g)  # Q K^T, then the mask and the scales, until the words
            if g > 0 and mutation != "score part rewritten early":
                yield ("named_sync", f"free{wg}")
            yield ("write", ("sx", wg), g, "sx")
            yield from rendezvous("ready")
            yield ("read_begin", ("sx", 1 - wg), g)
            yield ("read_end", ("sx", 1 - wg), g)
            yield ("named_arrive", f"free{1 - wg}")
            yield ("read_end", ("stage", s), g)
            yield from warps_arrive("empty", s)
            yield from pv(wg, g)
            g += 1
        yield from rendezvous("consumers")          # past the epilogue
    if g > 0:
        yield ("named_sync", f"free{wg}")          # the last arrival of the other warpgroup


# ---- the seesaw plan (seesaw.cuh: seesaw_consumer_loop) ----------------------------------------------------------
def seesaw_qk(g: int, slots: int):
    s = g % STAGES
    yield ("wait", "full", s, g // STAGES)
    yield ("read_begin", ("stage", s), g)
    yield ("read_begin", ("scales", g % slots), g)   # the fold of the group scales
    yield ("read_end", ("scales", g % slots), g)
    yield ("read_end", ("stage", s), g)
    yield from warps_arrive("empty", s)


def seesaw_words_pv(wg: int, g: int, slots: int, mutation=None):
    yield ("read_begin", ("scales", g % slots), g)   # the factors and the words
    yield ("read_end", ("scales", g % slots), g)
    if mutation != "scale slot never released":
        yield from warps_arrive("sc_empty", g % slots)
    yield from pv(wg, g)


def seesaw_consumer(wg: int, rows: list[int], slots: int, mutation=None):
    g_base = 0
    for n in rows:
        nblk = padded(n, True)
        yield from rendezvous("consumers")
        if nblk:
            yield from seesaw_qk(g_base + wg, slots)
        for b0 in range(0, nblk, 2):
            nxt = b0 + 2 < nblk
            g0 = g_base + b0
            if wg == 0:
                # softmax of b0: reads m1 of the last step (or the row's -inf), writes m0 and scale0
                last_m1 = 2 * (g0 - 2) + 1 if b0 else ("init", g_base)   # m1 of the previous step
                yield ("read_begin", "rowmax", last_m1)
                yield ("read_end", "rowmax", last_m1)
                yield ("write", "rowmax", 2 * g0, "rowmax")
                yield ("write", "scale0", g0, "one")
                yield ("named_arrive", "scale0")
                if b0 > 0 and mutation != "p0 rewritten early":
                    yield ("named_sync", "p0free")
                yield ("write", ("p16", 0), g0, "one")
                yield ("named_arrive", "p0")
                yield from seesaw_words_pv(0, g0, slots, mutation)
                yield ("named_sync", "scale1")
                yield ("read_begin", "scale1", g0)
                yield ("read_end", "scale1", g0)
                yield ("read_begin", ("p16", 1), g0 + 1)
                yield ("read_end", ("p16", 1), g0 + 1)
                yield from seesaw_words_pv(0, g0 + 1, slots, mutation)
                if nxt:
                    yield from seesaw_qk(g0 + 2, slots)
            else:
                yield ("named_sync", "scale0")
                yield ("read_begin", "scale0", g0)
                yield ("read_end", "scale0", g0)
                yield ("read_begin", "rowmax", 2 * g0)
                yield ("read_end", "rowmax", 2 * g0)
                yield ("write", "rowmax", 2 * g0 + 1, "rowmax")
                yield ("write", "scale1", g0, "one")
                yield ("write", ("p16", 1), g0 + 1, "one")
                yield ("named_arrive", "scale1")
                yield ("named_sync", "p0")
                yield ("read_begin", ("p16", 0), g0)
                yield ("read_end", ("p16", 0), g0)
                if nxt and mutation != "p0 rewritten early":
                    yield ("named_arrive", "p0free")
                yield from seesaw_words_pv(1, g0, slots, mutation)
                yield from seesaw_words_pv(1, g0 + 1, slots, mutation)
                if nxt:
                    yield from seesaw_qk(g0 + 3, slots)
        g_base += nblk
        # epilogue: both write their row sums, sync, read the final max, store, sync; the next row piece resets the
        # max (warpgroup 0 before the first sync of the next piece)
        yield from rendezvous("consumers")
        if nblk:
            yield ("read_begin", "rowmax", 2 * (g_base - 2) + 1)
            yield ("read_end", "rowmax", 2 * (g_base - 2) + 1)
        else:
            yield ("read_begin", "rowmax", ("init", g_base))
            yield ("read_end", "rowmax", ("init", g_base))
        yield from rendezvous("consumers")
        if wg == 0:
            yield ("write", "rowmax", ("init", g_base), "rowmax_init")


def run(rows: list[int], seesaw: bool, counts: dict[str, int] | None = None, seed: int = 0, mutation=None,
        starve: str | None = None) -> None:
    """One random interleaving of the CTA's agents over row pieces with these block counts."""
    counts = read_counts() if counts is None else counts
    sim = Sim(STAGES, {"kKvEmptyArrivals": 1, "kVtFullArrivals": 1, "kVtEmptyArrivals": 1})
    sim.count = {"full": 1, "empty": counts["seesaw_empty" if seesaw else "split_empty"], "vt_full": counts["vt_full"],
                 "vt_empty": counts["vt_empty"], "sc_empty": counts["sc_empty"]}
    slots = counts["slots"]
    blocks = sum(padded(n, seesaw) for n in rows)
    agents = {"gather": gather_agent(blocks, seesaw, slots, mutation)}
    for w in range(counts["warps"]):
        agents[f"transposer{w}"] = transposer_agent(blocks, mutation)
    for wg in (0, 1):
        agents[f"wg{wg}"] = (seesaw_consumer(wg, rows, slots, mutation) if seesaw
                             else split_consumer(wg, rows, mutation))
    # Readers a buffer's contents must have had before it is rewritten. The transposer warps arrive on the stage's
    # empty barrier once each, so each is a reader; split: both consumer warpgroups read a stage; seesaw: its owner.
    # (Each transposer warp reads a stage twice, once for each V^T half.) The running max: m0 of a step is read by
    # warpgroup 1, m1 by warpgroup 0 in the next step, the last m1 of a row piece by both in the epilogue, before
    # warpgroup 0 resets it for the next piece ("rowmax_init").
    readers = {"stage": counts["warps"] * 2 + (1 if seesaw else 2), "scales": 3, "vt": 1, "sx": 1, "one": 1,
               "rowmax": 1, "rowmax_init": 2}
    both = {"consumers", "ready"}   # named barriers both warpgroups sync on (rendezvous above)
    named = {name: [0, 0] for name in ("free0", "free1", "scale0", "scale1", "p0", "p0free")}
    gen = {(b, w): 0 for b in both for w in ("wg0", "wg1")}

    def ready(name, op) -> bool:
        kind = op[0]
        if kind == "wait":
            return sim.can_wait(op[1], op[2], op[3], name)
        if kind == "both_wait":
            other = "wg1" if name == "wg0" else "wg0"
            return gen[(op[1], other)] >= gen[(op[1], name)]
        if kind == "named_sync":
            return named[op[1]][0] > named[op[1]][1]
        return True

    def execute(name, op) -> None:
        if sim.apply(op, readers, name):
            return
        if op[0] == "named_arrive":
            named[op[1]][0] += 1
        elif op[0] == "both_arrive":
            gen[(op[1], name)] += 1
        elif op[0] == "named_sync":
            named[op[1]][1] += 1

    sim.holder["rowmax"] = ("init", 0)
    _dense.interleave(agents, ready, execute, seed, starve, f"rows {rows} ({'seesaw' if seesaw else 'split'})")
    unbalanced = {b: v for b, v in named.items() if v[0] != v[1]}
    if unbalanced:
        raise ProtocolError(f"named barriers left with arrivals and waits unequal over rows {rows}: {unbalanced}")


def check_all(seeds: int = 20) -> int:
    """Both plans over row sequences of 0..9 blocks; returns the number of runs."""
    counts = read_counts()
    gen = random.Random(3)
    sequences = [[n] for n in range(10)] + [[a, b] for a in range(5) for b in range(5)]
    sequences += [[gen.randrange(0, 10) for _ in range(gen.randrange(1, 5))] for _ in range(15)]
    starved = [None, "gather", "wg0", "wg1"] + [f"transposer{w}" for w in range(counts["warps"])]
    runs = 0
    for seesaw in (False, True):
        for rows in sequences:
            for seed in range(seeds):
                run(rows, seesaw, counts, seed=seed, starve=starved[seed % len(starved)])
                runs += 1
    return runs


if __name__ == "__main__":
    try:
        n = check_all()
    except ProtocolError as e:
        print(f"sparse protocol model: INCONSISTENT: {e}")
        sys.exit(1)
    print(f"sparse protocol model: consistent ({n} interleavings of the split and the seesaw plan)")
