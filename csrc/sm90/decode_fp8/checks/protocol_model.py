#!/usr/bin/env python3
"""Python model of the sm90 FP8 tensor-core decode kernel's barrier protocol (producer and consumers; run_cluster: the
2-CTA clusters that share the V transposition).

A mirror of the order of waits, arrivals, reads and writes in producer.cuh (copy_loop, transpose_loop), mainloop.cuh
(mainloop_wg0 / mainloop_wg1, run_steps, padded_blocks), mainloop_vregs.cuh (the V-in-registers tile: no transposer,
both warpgroups read V from the KV stage) and kernel.cuh (the consumers' request barriers); the stage counts come from
launch.cuh's VariantTraits and the arrival counts from traits.h and vregs.h, so a change there is checked as it is. It is not a test of the compiled code: keep the agents below in step with those files when the schedule changes.
Run by tests/test_device_checks.py; `python3 protocol_model.py` prints the verdict.

Each role is an agent (the copy lane, the three transposer warps, the two consumer warpgroups) that runs its
sequence of operations; a random scheduler interleaves them, many times per sequence of request pieces. Checked:
  - no deadlock: some agent can always move until all have finished;
  - a wait for completion n of an mbarrier (parity n & 1) never finds completion n + 1 already past (the hardware
    would then miss the phase and hang), nor only n - 1 completions (it would pass at once, on the parity of
    completion n - 2);
  - data: a KV stage is written (TMA) only after every reader of its previous block (the owner's Q K^T, the four
    piece pairs of the transposition) finished; a V^T half slot is written only after the P V of its previous block
    in the consumer warpgroup that reads that half finished; a reader reads only the block it expects, after it was
    written.
"""
from __future__ import annotations

import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAUNCH_CUH = HERE.parent / "launch.cuh"
TRAITS_H = HERE.parent / "traits.h"
VREGS_H = HERE.parent / "vregs.h"


class ProtocolError(AssertionError):
    """A schedule the kernel would get wrong: a hang, a skipped barrier phase or a read of stale data."""


def read_variants(launch_cuh: Path = LAUNCH_CUH) -> dict[str, tuple[int, int, int, int, bool]]:
    """{variant: (q terms, KV stages, left V^T ring, right V^T ring, fp16 P V)} from VariantTraits in launch.cuh (the
    last is Traits' kPvF16, after the registers and kShareVt; kStackedTerms, after it, changes where Q's rows live, not
    the protocol; kMulticastKv, the last, adds the peer CTA's releases to kv_empty's count, a cross-CTA wait this
    model does not play: such a variant is checked as its one CTA; kShareVt's variants are checked as one CTA here
    and as two by run_cluster)."""
    text = launch_cuh.read_text()
    found = re.findall(r"VariantTraits<Variant::(\w+)>\s*\{\s*using type = Traits<[^,>]+,\s*(\d+),\s*(\d+)"
                       r"(?:,\s*(\d+))?(?:,\s*(\d+))?(?:,\s*\d+)*(?:,\s*(true|false))?(?:,\s*(true|false))?"
                       r"(?:,\s*(?:true|false))?(?:,\s*(?:true|false))?>", text)
    if not found:
        raise ProtocolError(f"no VariantTraits found in {launch_cuh}")
    # Every specialization but the V-in-registers tile's and the keys-on-M tile's, however it is written.
    declared = [name for name, body in re.findall(r"struct VariantTraits<Variant::(\w+)>\s*\{([^}]*)\}", text)
                if "TraitsVR<" not in body and "TraitsKM<" not in body]
    if len(declared) != len(found):
        missed = sorted(set(declared) - {f[0] for f in found})
        raise ProtocolError(f"VariantTraits of {launch_cuh} the model cannot read (new Traits arguments?): {missed}")
    return {name: (int(a), int(c), int(d) if d else 2, int(e) if e else 2, f16 == "true")
            for name, a, c, d, e, _share, f16 in found}


def read_cluster_variants(launch_cuh: Path = LAUNCH_CUH) -> dict[str, tuple[int, int, int]]:
    """{variant: (KV stages, left ring, right ring)} of the VariantTraits whose kShareVt is true: the 2-CTA clusters
    that share the fast mode's V transposition, which run_cluster plays (traits.h asserts kShareVt only with an e4m3
    q, so never with the fp16 P V of kPvF16)."""
    text = launch_cuh.read_text()
    found = re.findall(r"VariantTraits<Variant::(\w+)>\s*\{\s*using type = Traits<[^,>]+,\s*(\d+),\s*(\d+)"
                       r",\s*(\d+),\s*(\d+),\s*\d+,\s*\d+,\s*true(?:,\s*(true|false))?", text)
    if any(f16 == "true" for *_, f16 in found):
        raise ProtocolError(f"a kShareVt variant with kPvF16 in {launch_cuh}: the model plays only the transposition")
    return {name: (int(stages), int(left), int(right)) for name, _, stages, left, right, _ in found}


def read_vregs_variants(launch_cuh: Path = LAUNCH_CUH) -> dict[str, int]:
    """{variant: KV stages} of the V-in-registers tile's VariantTraits (TraitsVR<q type, stages, ...>)."""
    text = launch_cuh.read_text()
    found = re.findall(r"VariantTraits<Variant::(\w+)>\s*\{\s*using type = TraitsVR<[^,>]+,\s*(\d+)", text)
    declared = re.findall(r"VariantTraits<Variant::(\w+)>\s*\{\s*using type = TraitsVR<", text)
    if len(declared) != len(found):
        raise ProtocolError(f"TraitsVR variants of {launch_cuh} the model cannot read: {sorted(set(declared))}")
    return {name: int(stages) for name, stages in found}


def read_vregs_kv_empty_arrivals(vregs_h: Path = VREGS_H) -> int:
    """vregs.h's kKvEmptyArrivalsVRegs (kNumConsumerThreads substituted)."""
    m = re.search(r"constexpr uint32_t kKvEmptyArrivalsVRegs = ([^;]+);", vregs_h.read_text())
    if not m:
        raise ProtocolError(f"kKvEmptyArrivalsVRegs not found in {vregs_h}")
    return int(eval(m.group(1), {}, {"kNumConsumerThreads": 2 * 128}))  # noqa: S307 (a constant expression)


V_PIECES = 8  # config.h: kNumVPieces, the 512 value columns in pieces of 64


def read_arrivals(traits_h: Path = TRAITS_H) -> dict[str, int]:
    """kKvEmptyArrivals, kVtFullArrivals, kVtEmptyArrivals of traits.h (kNumTransposeWarps, kNumVPairs substituted)."""
    text = traits_h.read_text()
    warps = re.search(r"constexpr int kNumTransposeWarps = (\d+);", text)
    pairs = re.search(r"constexpr int kNumVPairs = ([^;]+);", text)
    if not warps or not pairs:
        raise ProtocolError(f"kNumTransposeWarps or kNumVPairs not found in {traits_h}")
    env = {"kNumTransposeWarps": int(warps.group(1)), "kNumVPieces": V_PIECES}
    env["kNumVPairs"] = int(eval(pairs.group(1), {}, dict(env)))  # noqa: S307 (a constant expression of traits.h)
    out = {}
    for name in ("kKvEmptyArrivals", "kVtFullArrivals", "kVtEmptyArrivals"):
        m = re.search(rf"constexpr uint32_t {name} = ([^;]+);", text)
        if not m:
            raise ProtocolError(f"{name} not found in {traits_h}")
        out[name] = int(eval(m.group(1), {}, dict(env)))  # noqa: S307 (a constant expression of traits.h)
    out["kNumTransposeWarps"] = env["kNumTransposeWarps"]
    out["kNumVPairs"] = env["kNumVPairs"]
    return out


def padded_blocks(n: int) -> int:
    return (n + 1) & ~1 if n > 0 else 0


class VtRings:
    """traits.h's vt_slot / vt_use: half h of block g in slot g % ring[h] of its half's ring (the left ring first);
    and vt_empty_of: the release of use u of a slot goes to the slot's barrier u % kVtEmptyCopies, as completion
    u // kVtEmptyCopies of it."""

    def __init__(self, left: int, right: int, stages: int):
        self.ring = (left, right)
        self.copies = vt_empty_copies(stages, left, right)

    def slot(self, h: int, g: int) -> int:
        return g % self.ring[0] if h == 0 else self.ring[0] + g % self.ring[1]

    def use(self, h: int, g: int) -> int:
        return g // self.ring[h]

    def empty(self, slot: int, use: int) -> tuple[tuple[int, int], int]:
        """(vt_empty barrier, completion) of the release of `use` of `slot`."""
        return (slot, use % self.copies), use // self.copies


def vt_empty_copies(stages: int, left: int, right: int) -> int:
    """traits.h's kVtEmptyCopies: ceil(stages / shortest ring)."""
    return -(-stages // min(left, right))


class Sim:
    def __init__(self, stages: int, arrivals: dict[str, int]):
        self.kS = stages
        self.count = {"kv_full": 1, "kv_empty": arrivals["kKvEmptyArrivals"], "vt_full": arrivals["kVtFullArrivals"],
                      "vt_empty": arrivals["kVtEmptyArrivals"]}
        self.done = {}      # (barrier, index) -> completed phases
        self.got = {}       # (barrier, index) -> arrivals in the current phase
        self.named = {}     # named barrier -> (arrivals, syncs) per generation
        self.holder = {}    # resource -> block written there
        self.readers = {}   # resource -> {block: finished reads}
        self.active = {}    # resource -> number of reads in progress

    # ---- mbarriers -------------------------------------------------------------------------------------------
    def count_of(self, bar, i: int) -> int:
        """Arrivals that complete a phase of bar[i]."""
        return self.count[bar]

    def arrive(self, bar, i: int) -> None:
        key = (bar, i)
        self.got[key] = self.got.get(key, 0) + 1
        if self.got[key] == self.count_of(bar, i):
            self.got[key] = 0
            self.done[key] = self.done.get(key, 0) + 1

    def can_wait(self, bar: str, i: int, n: int, who: str) -> bool:
        """The hardware's parity wait: it passes when the barrier's completed phases c and n + 1 have the same
        parity. So it passes early at c = n - 1 (a waiter two phases ahead), and too late to tell at c >= n + 2."""
        c = self.done.get((bar, i), 0)
        if c >= n + 2:
            raise ProtocolError(f"{who}: waits for completion {n} of {bar}[{i}], which has {c}: the phase was missed")
        if c == n - 1:
            raise ProtocolError(f"{who}: waits for completion {n} of {bar}[{i}], which has only {c}: the parity wait "
                                f"would pass on completion {c - 1}")
        return c >= n + 1

    # ---- data ------------------------------------------------------------------------------------------------
    def write(self, res, block: int, expected_readers: int, who: str) -> None:
        prev = self.holder.get(res)
        if prev is not None and prev != block:
            if self.active.get(res, 0):
                raise ProtocolError(f"{who}: writes block {block} into {res} while block {prev} is being read")
            if self.readers.get(res, {}).get(prev, 0) < expected_readers:
                raise ProtocolError(f"{who}: writes block {block} into {res} before block {prev} was read by all "
                                    f"({self.readers.get(res, {}).get(prev, 0)} of {expected_readers})")
        self.holder[res] = block

    def read_begin(self, res, block: int, who: str) -> None:
        if self.holder.get(res) != block:
            raise ProtocolError(f"{who}: reads block {block} from {res}, which holds {self.holder.get(res)}")
        self.active[res] = self.active.get(res, 0) + 1

    def read_end(self, res, block: int) -> None:
        self.active[res] -= 1
        self.readers.setdefault(res, {})
        self.readers[res][block] = self.readers[res].get(block, 0) + 1

    def apply(self, op, readers: dict, who: str) -> bool:
        """Carries out an mbarrier arrival or a data operation (readers: a write's expected readers by kind);
        False for the other kinds, which are the caller's (named barriers)."""
        kind = op[0]
        if kind == "arrive":
            self.arrive(op[1], op[2])
        elif kind == "write":
            self.write(op[1], op[2], readers[op[3]], who)
        elif kind == "read_begin":
            self.read_begin(op[1], op[2], who)
        elif kind == "read_end":
            self.read_end(op[1], op[2])
        else:
            return False
        return True


def interleave(agents: dict, ready, execute, seed: int, starve: str | None, what: str) -> None:
    """Runs the agents (generators of operations) to the end in one random order: at each step one agent whose next
    operation is ready(name, op) executes it; `starve` moves only when no other can. Raises ProtocolError naming
    `what` when none can move."""
    pending = {name: next(agent, None) for name, agent in agents.items()}
    rng = random.Random(seed)
    while any(op is not None for op in pending.values()):
        runnable = [n for n, op in pending.items() if op is not None and ready(n, op)]
        if not runnable:
            stuck = {n: op for n, op in pending.items() if op is not None}
            raise ProtocolError(f"deadlock over {what}: {stuck}")
        if starve in runnable and len(runnable) > 1:
            runnable.remove(starve)
        name = rng.choice(runnable)
        execute(name, pending[name])
        pending[name] = next(agents[name], None)


# Operations an agent yields: ("wait", bar, i, n) blocks until completion n of bar[i]; ("arrive", bar, i);
# ("named_arrive", id) / ("named_sync", id): the consumers' named barriers (one arrive and one sync per generation,
# or two syncs for kConsumers); ("write"|"read_begin"|"read_end", resource, block[, readers]).
def copy_agent(blocks, kS, mutation=None):
    for x in range(blocks):
        if x >= kS and mutation != "copy ignores kv_empty":
            yield ("wait", "kv_empty", x % kS, x // kS - 1)
        yield ("write", ("kv", x % kS), x, "kv")
        yield ("arrive", "kv_full", x % kS)


def transposer_agent(tw, blocks, kS, vt: VtRings, warps: int, pairs: int, mutation=None):
    for g in range(blocks):
        for pair in range((tw + warps - g % warps) % warps, pairs, warps):  # round-robin, shifted by one per block
            h = pair // (pairs // 2)
            slot, use = vt.slot(h, g), vt.use(h, g)
            if use > 0 and mutation != "transposer ignores vt_empty":
                bar, n = vt.empty(slot, use - 1)
                yield ("wait", "vt_empty", bar, n)
            yield ("wait", "kv_full", g % kS, g // kS)
            yield ("read_begin", ("kv", g % kS), g)
            yield ("write", ("vt", slot), g, "vt")
            yield ("read_end", ("kv", g % kS), g)
            yield ("arrive", "vt_full", slot)
            if mutation != "transposer does not release the stage":
                yield ("arrive", "kv_empty", g % kS)


def qk(g, kS):
    yield ("wait", "kv_full", g % kS, g // kS)
    yield ("read_begin", ("kv", g % kS), g)


CONSUMER_WARPS = 4  # each warp of a consumer warpgroup arrives once it waited for its wgmma (mainloop.cuh: warp_arrive)


def qk_done(g, kS):
    yield ("read_end", ("kv", g % kS), g)
    for _ in range(CONSUMER_WARPS):
        yield ("arrive", "kv_empty", g % kS)


def pv_issue(g, h, vt: VtRings):
    yield ("wait", "vt_full", vt.slot(h, g), vt.use(h, g))
    yield ("read_begin", ("vt", vt.slot(h, g)), g)


def pv_done(g, h, vt: VtRings):
    yield ("read_end", ("vt", vt.slot(h, g)), g)
    for _ in range(CONSUMER_WARPS):
        yield ("arrive", "vt_empty", vt.empty(vt.slot(h, g), vt.use(h, g))[0])


def f16pv_step(wg, g0, nxt, first, kS, kVt: VtRings, mutation=None):
    """One step of the fp16 P V mode (mainloop.cuh: mainloop_wg0, mainloop_f16pv.cuh: mainloop_f16pv_wg1): both
    warpgroups read their halves in block order; P0 goes to warpgroup 1 unscaled (p0, once warpgroup 1 loaded the
    previous one: p0free), P1 to both through the p[1] buffer."""
    def second_pv():
        # Both warpgroups end a step alike: P1 from p[1], the P V of block g0 + 1, and the next Q K^T issued after it
        # (block g0 + 2 in warpgroup 0, g0 + 3 in warpgroup 1).
        yield ("read_begin", ("p", 1), g0 + 1)
        yield ("read_end", ("p", 1), g0 + 1)
        yield from pv_issue(g0 + 1, wg, kVt)
        if nxt:
            yield from qk(g0 + 2 + wg, kS)
        yield from pv_done(g0 + 1, wg, kVt)
        if nxt:
            yield from qk_done(g0 + 2 + wg, kS)

    if wg == 0:
        yield ("named_arrive", "scale0")
        if not first and mutation != "p0 rewritten early":
            yield ("named_sync", "p0free")
        yield ("write", ("p", 0), g0, "p0")
        yield ("named_arrive", "p0")
        yield from pv_issue(g0, wg, kVt)
        yield ("named_sync", "scale1")
        yield from pv_done(g0, wg, kVt)
        yield from second_pv()
    else:
        yield ("named_sync", "scale0")
        yield ("write", ("p", 1), g0 + 1, "p1")
        yield ("named_arrive", "scale1")
        yield ("named_sync", "p0")
        yield ("read_begin", ("p", 0), g0)
        yield ("read_end", ("p", 0), g0)
        if nxt and mutation != "p0 rewritten early":
            yield ("named_arrive", "p0free")
        yield from pv_issue(g0, wg, kVt)
        yield from pv_done(g0, wg, kVt)
        yield from second_pv()


def vregs_v_read(g, kS, mutation=None):
    """A warpgroup's P V of block g in the V-in-registers tile (mainloop_vregs.cuh): the stage's V is read into
    registers (ldmatrix) and each warp arrives on kv_empty once its reads are done."""
    yield ("wait", "kv_full", g % kS, g // kS)
    yield ("read_begin", ("kv", g % kS), g)
    if mutation != "vregs early kv_empty":
        yield ("read_end", ("kv", g % kS), g)
    for _ in range(CONSUMER_WARPS):
        yield ("arrive", "kv_empty", g % kS)
    if mutation == "vregs early kv_empty":
        yield ("read_end", ("kv", g % kS), g)


def vregs_step(wg, g0, nxt, first, kS, mutation=None):
    """One step of the V-in-registers tile (mainloop_vregs.cuh: mainloop_vregs): each warpgroup writes its block's P
    (pt[wg]) and its rows' factors (scale[wg]), reads both P tiles and both factor arrays, and reads V of both blocks
    from the KV stages; its next Q K^T (block g0 + 2 + wg) is issued before the P V of block g0 + 1 and waited for at
    the step's end. The row factors: scale0 is read by warpgroup 0 (O^T sc0) and by warpgroup 1 (its rows' sc0, then
    O^T sc0, before it publishes scale1); scale1 by warpgroup 0 after kScale1Ready and by warpgroup 1 after its P0 V."""
    def pv1_and_next_qk():
        if nxt:
            yield from qk(g0 + 2 + wg, kS)
        yield ("read_begin", ("pt", 1), g0 + 1)
        yield from vregs_v_read(g0 + 1, kS, mutation)
        yield ("read_end", ("pt", 1), g0 + 1)          # wait<0>: the P V and the Q K^T completed
        if nxt:
            yield ("read_end", ("kv", (g0 + 2 + wg) % kS), g0 + 2 + wg)
            if wg == 0:
                yield ("named_arrive", "p1free")

    if wg == 0:
        yield ("write", ("scale", 0), g0, "scale")
        yield ("named_arrive", "scale0")
        if not first and mutation != "vregs p0 rewritten early":
            yield ("named_sync", "p0free")
        yield ("write", ("pt", 0), g0, "pt")
        yield ("named_arrive", "p0")
        yield ("read_begin", ("scale", 0), g0)
        yield ("read_end", ("scale", 0), g0)              # O^T sc0
        yield ("read_begin", ("pt", 0), g0)
        yield from vregs_v_read(g0, kS, mutation)
        yield ("named_sync", "scale1")
        yield ("read_end", ("pt", 0), g0)                 # wait<0>
        yield ("read_begin", ("scale", 1), g0 + 1)
        yield ("read_end", ("scale", 1), g0 + 1)          # row sums and O^T sc1
        yield from pv1_and_next_qk()
    else:
        yield ("named_sync", "scale0")
        yield ("read_begin", ("scale", 0), g0)            # the rows' sc0
        yield ("write", ("scale", 1), g0 + 1, "scale")
        if not first:
            yield ("named_sync", "p1free")
        yield ("write", ("pt", 1), g0 + 1, "pt")
        if mutation == "vregs scale0 read late":
            yield ("named_arrive", "scale1")
            yield ("read_end", ("scale", 0), g0)
        else:
            yield ("read_end", ("scale", 0), g0)          # O^T sc0, before scale1 is published
            yield ("named_arrive", "scale1")
        yield ("named_sync", "p0")
        yield ("read_begin", ("pt", 0), g0)
        yield from vregs_v_read(g0, kS, mutation)
        yield ("read_end", ("pt", 0), g0)                 # wait<0>
        if nxt:
            yield ("named_arrive", "p0free")
        yield ("read_begin", ("scale", 1), g0 + 1)
        yield ("read_end", ("scale", 1), g0 + 1)          # O^T sc1
        yield from pv1_and_next_qk()


def consumer_agent(wg, requests, kS, kVt: VtRings, mutation=None, f16pv=False, vregs=False):
    # Warpgroup wg reads V^T half wg of every block.
    g_base = 0
    for n in requests:
        yield ("named_sync", "consumers")      # Q tile ready
        yield ("named_sync", "consumers")      # per-row scales written
        nblk = padded_blocks(n)
        if nblk:
            first = g_base + wg
            yield from qk(first, kS)
            if vregs:
                yield ("read_end", ("kv", first % kS), first)   # the stage is released after its V reads
            else:
                yield from qk_done(first, kS)
            for b0 in range(0, nblk, 2):
                nxt = b0 + 2 < nblk
                g0 = g_base + b0
                if vregs:
                    yield from vregs_step(wg, g0, nxt, b0 == 0, kS, mutation)
                elif f16pv:
                    yield from f16pv_step(wg, g0, nxt, b0 == 0, kS, kVt, mutation)
                elif wg == 0:
                    yield ("named_arrive", "scale0")
                    yield from pv_issue(g0, wg, kVt)
                    yield ("named_sync", "scale1")
                    yield ("named_arrive", "p0")
                    yield from pv_done(g0, wg, kVt)
                    yield from pv_issue(g0 + 1, wg, kVt)
                    if nxt:
                        yield from qk(g0 + 2, kS)
                    yield from pv_done(g0 + 1, wg, kVt)
                    if nxt:
                        yield from qk_done(g0 + 2, kS)
                else:
                    yield ("named_sync", "scale0")
                    yield ("named_arrive", "scale1")
                    yield from pv_issue(g0 + 1, wg, kVt)
                    yield ("named_sync", "p0")
                    if mutation == "early vt_empty":
                        for _ in range(CONSUMER_WARPS):
                            yield ("arrive", "vt_empty", kVt.empty(kVt.slot(1, g0), kVt.use(1, g0))[0])
                    yield from pv_issue(g0, wg, kVt)
                    if nxt:
                        yield from qk(g0 + 3, kS)   # its nine pieces are waited for before the batch is issued
                    yield from pv_done(g0 + 1, wg, kVt)
                    if mutation == "early vt_empty":
                        yield ("read_end", ("vt", kVt.slot(1, g0)), g0)
                    else:
                        yield from pv_done(g0, wg, kVt)
                    if nxt:
                        yield from qk_done(g0 + 3, kS)
        g_base += nblk
        yield ("named_sync", "consumers")      # past the main loop
        yield ("named_sync", "consumers")      # past the epilogue


def run(requests: list[int], stages: int, vt_rings: tuple[int, int],
        arrivals: dict[str, int] | None = None, seed: int = 0, mutation: str | None = None,
        f16pv: bool = False, starve: str | None = None, vregs: bool = False) -> None:
    """One random interleaving of the CTA's agents over request pieces with these block counts. `starve` names an
    agent that moves only when no other can (the interleavings where one role lags far behind the others). vregs: the
    V-in-registers tile (no transposer warps; vt_rings unused)."""
    arrivals = dict(read_arrivals() if arrivals is None else arrivals)
    if vregs:
        arrivals["kKvEmptyArrivals"] = read_vregs_kv_empty_arrivals()
    sim = Sim(stages, arrivals)
    vt = VtRings(*vt_rings, stages)
    blocks = sum(padded_blocks(n) for n in requests)
    agents = {"copy": copy_agent(blocks, stages, mutation)}
    if not vregs:
        for w in range(arrivals["kNumTransposeWarps"]):
            agents[f"transposer{w}"] = transposer_agent(w, blocks, stages, vt, arrivals["kNumTransposeWarps"],
                                                        arrivals["kNumVPairs"], mutation)
    for wg in (0, 1):
        agents[f"wg{wg}"] = consumer_agent(wg, requests, stages, vt, mutation, f16pv, vregs)
    # Named barriers: generation counters. scale0 / scale1 / p0 / p0free / p1free: one side arrives, the other syncs;
    # consumers: both warpgroups sync (a generation completes when both arrived).
    named = {"scale0": [0, 0], "scale1": [0, 0], "p0": [0, 0], "p0free": [0, 0], "p1free": [0, 0]}
    consumer_gen = {"wg0": 0, "wg1": 0}
    # Readers a buffer's block must have had before it is rewritten. V-in-registers: a stage is read by its owner's
    # Q K^T and by both warpgroups' V reads; each P tile and each factor array by both warpgroups.
    readers = {"kv": 3 if vregs else 1 + arrivals["kNumVPairs"], "vt": 1, "p0": 1, "p1": 2, "pt": 2, "scale": 2}

    def ready(name, op) -> bool:
        kind = op[0]
        if kind == "wait":
            return sim.can_wait(op[1], op[2], op[3], name)
        if kind == "named_sync":
            if op[1] == "consumers":
                other = "wg1" if name == "wg0" else "wg0"
                return consumer_gen[other] >= consumer_gen[name]
            return named[op[1]][0] > named[op[1]][1]
        return True

    def execute(name, op) -> None:
        if sim.apply(op, readers, name):
            return
        if op[0] == "named_arrive":
            named[op[1]][0] += 1
        elif op[0] == "named_sync":
            if op[1] == "consumers":
                consumer_gen[name] += 1
            else:
                named[op[1]][1] += 1

    interleave(agents, ready, execute, seed, starve,
               f"requests {requests} (stages {stages}, V^T rings {vt_rings})")


def run_cluster(requests: list[int], stages: int, vt_rings: tuple[int, int],
                arrivals: dict[str, int] | None = None, seed: int = 0, mutation: str | None = None,
                starve: str | None = None) -> None:
    """One random interleaving of a 2-CTA cluster that shares the V transposition (Traits::kShareVt;
    producer.cuh: transpose_loop_shared, send_vt_half; mainloop.cuh: release_vt). Both CTAs walk the same blocks.
    CTA r's transposer warps write only half r of each block (its two piece pairs, pair i of block g on warp
    (2 g + i) % warps), each pair waiting for the slot's local release (vt_empty) and then for the peer's release of
    its copy (peer_empty, one barrier a slot), and the half's sender (the second pair to finish, a shared counter)
    waits for the slot's vt_full and queues a bulk copy. Each CTA's copy engine (agent dma<r>) carries the queued
    copies out in order at any later time: it reads the local slot (which must still hold the block) and writes the
    peer's slot, completing its vt_full (one arrival). A consumer warpgroup releases a copied half on the peer's
    peer_empty instead of the local vt_empty. Each CTA's copy lane and consumers are the one-CTA agents, their
    barriers, buffers and named barriers the CTA's own. Mutation: "no peer_empty" (a pair does not wait for the peer's
    release)."""
    arrivals = dict(read_arrivals() if arrivals is None else arrivals)
    warps, pairs = arrivals["kNumTransposeWarps"], arrivals["kNumVPairs"]
    vt = VtRings(*vt_rings, stages)
    blocks = sum(padded_blocks(n) for n in requests)
    # traits.h: kKvEmptyArrivalsShared (the owner's four warps and this CTA's two pairs), kVtFullArrivalsCopied (the
    # peer's one arrival with the bytes), kPeerEmptyArrivals (the four warps of the consumer that read the copy).
    counts = {"kv_full": 1, "kv_empty": CONSUMER_WARPS + pairs // 2, "vt_empty": arrivals["kVtEmptyArrivals"],
              "peer_empty": CONSUMER_WARPS}
    half_of_slot = {vt.slot(h, g): h for h in (0, 1) for g in range(max(vt.ring))}

    class ClusterSim(Sim):
        def count_of(self, bar, i: int) -> int:
            r, base = bar
            if base == "vt_full":
                return arrivals["kVtFullArrivals"] if half_of_slot[i] == r else 1
            return counts[base]

    sim = ClusterSim(stages, arrivals)
    # A half of the CTA's own is read by its consumer warpgroup and by the copy to the peer; a copied one by the
    # consumer alone.
    readers = {"kv": 1 + pairs // 2, "vt": 1, "vt_own": 2, "p0": 1, "p1": 2}
    queue = {0: [], 1: []}
    sent = {}   # (cta, slot) -> pairs written so far (vt_pairs_sent)

    def local(gen, r, wg=None):
        """A one-CTA agent's operations on CTA r's barriers, buffers and named barriers; a consumer warpgroup's
        release of the half it gets from the peer goes to the peer's peer_empty."""
        for op in gen:
            kind = op[0]
            if kind == "wait":
                yield ("wait", (r, op[1]), op[2], op[3])
            elif kind == "arrive":
                if wg is not None and op[1] == "vt_empty" and half_of_slot[op[2][0]] != r:
                    yield ("arrive", (1 - r, "peer_empty"), op[2][0])   # one barrier a slot
                else:
                    yield ("arrive", (r, op[1]), op[2])
            elif kind == "write":
                yield ("write", (r, op[1]), op[2], op[3])
            elif kind in ("read_begin", "read_end"):
                if op[1][0] == "vt":   # a V half is read whole: both piece pairs' parts
                    for part in (0, 1):
                        yield (kind, (r, ("vt", op[1][1], part)), op[2])
                else:
                    yield (kind, (r, op[1]), op[2])
            else:   # named barriers
                yield (kind, (r, op[1]))

    def transposer(r, tw):
        for g in range(blocks):
            for i in (0, 1):
                if (2 * g + i) % warps != tw:
                    continue
                slot, use = vt.slot(r, g), vt.use(r, g)
                if use > 0:
                    bar, n = vt.empty(slot, use - 1)
                    yield ("wait", (r, "vt_empty"), bar, n)
                    if mutation != "no peer_empty":   # after vt_empty: see traits.h, ShareVtState
                        yield ("wait", (r, "peer_empty"), slot, use - 1)
                yield ("wait", (r, "kv_full"), g % stages, g // stages)
                yield ("read_begin", (r, ("kv", g % stages)), g)
                yield ("write", (r, ("vt", slot, i)), g, "vt_own")   # pair i's part of the half
                yield ("read_end", (r, ("kv", g % stages)), g)
                yield ("arrive", (r, "vt_full"), slot)
                yield ("arrive", (r, "kv_empty"), g % stages)
                sent[(r, slot)] = sent.get((r, slot), 0) + 1
                if sent[(r, slot)] % 2 == 0:
                    yield ("wait", (r, "vt_full"), slot, use)
                    yield ("send", r, slot, g)

    def dma(r):
        for _ in range(blocks):
            yield ("dma", r)

    agents = {}
    for r in (0, 1):
        agents[f"copy{r}"] = local(copy_agent(blocks, stages), r)
        for w in range(warps):
            agents[f"transposer{r}.{w}"] = transposer(r, w)
        agents[f"dma{r}"] = dma(r)
        for wg in (0, 1):
            agents[f"wg{wg}@{r}"] = local(consumer_agent(wg, requests, stages, vt, None, False), r, wg)
    named = {}
    consumer_gen = {}

    def ready(name, op) -> bool:
        kind = op[0]
        if kind == "wait":
            return sim.can_wait(op[1], op[2], op[3], name)
        if kind == "dma":
            return bool(queue[op[1]])
        if kind == "named_sync":
            r, nid = op[1]
            if nid == "consumers":
                wg = name.split("@")[0]
                other = f"{'wg1' if wg == 'wg0' else 'wg0'}@{r}"
                return consumer_gen.get(other, 0) >= consumer_gen.get(name, 0)
            arr, syn = named.get(op[1], (0, 0))
            return arr > syn
        return True

    def execute(name, op) -> None:
        kind = op[0]
        if kind == "send":
            queue[op[1]].append((op[2], op[3]))
        elif kind == "dma":
            r = op[1]
            slot, g = queue[r].pop(0)
            for part in (0, 1):   # the whole half: both pairs' parts must hold the block
                sim.read_begin((r, ("vt", slot, part)), g, name)
                sim.read_end((r, ("vt", slot, part)), g)
                sim.write((1 - r, ("vt", slot, part)), g, readers["vt"], name)
            sim.arrive((1 - r, "vt_full"), slot)
        elif sim.apply(op, readers, name):
            return
        elif kind == "named_arrive":
            arr, syn = named.get(op[1], (0, 0))
            named[op[1]] = (arr + 1, syn)
        elif kind == "named_sync":
            if op[1][1] == "consumers":
                consumer_gen[name] = consumer_gen.get(name, 0) + 1
            else:
                arr, syn = named.get(op[1], (0, 0))
                named[op[1]] = (arr, syn + 1)

    interleave(agents, ready, execute, seed, starve,
               f"cluster requests {requests} (stages {stages}, V^T rings {vt_rings})")


def check_all(seeds: int = 30) -> int:
    """Every variant of launch.cuh over request sequences of 0..7 blocks; returns the number of runs."""
    runs = 0
    gen = random.Random(1)
    sequences = [[n] for n in range(8)] + [[a, b] for a in range(6) for b in range(6)]
    sequences += [[gen.randrange(0, 12) for _ in range(gen.randrange(1, 5))] for _ in range(20)]
    starved = [None, "copy", "wg0", "wg1"] + [f"transposer{w}" for w in range(read_arrivals()["kNumTransposeWarps"])]
    for name, (_, stages, left, right, f16pv) in read_variants().items():
        for reqs in sequences:
            for seed in range(seeds):
                run(reqs, stages, (left, right), seed=seed, f16pv=f16pv,
                    starve=starved[seed % len(starved)])
                runs += 1
    for name, stages in read_vregs_variants().items():
        for reqs in sequences:
            for seed in range(seeds):
                run(reqs, stages, (1, 1), seed=seed, vregs=True, starve=[None, "copy", "wg0", "wg1"][seed % 4])
                runs += 1
    starved = [None, "dma0", "dma1", "wg0@0", "wg1@1", "copy0", "transposer1.0"]
    for name, (stages, left, right) in read_cluster_variants().items():
        for reqs in sequences:
            for seed in range(seeds // 3):
                run_cluster(reqs, stages, (left, right), seed=seed, starve=starved[seed % len(starved)])
                runs += 1
    return runs


if __name__ == "__main__":
    try:
        n = check_all()
    except ProtocolError as e:
        print(f"protocol model: INCONSISTENT: {e}")
        sys.exit(1)
    names = [*read_variants(), *read_vregs_variants(), *(f"{v} as a cluster" for v in read_cluster_variants())]
    print(f"protocol model: consistent ({n} interleavings of {', '.join(names)})")
