# Python model of the sm90 decode kernel's KV load / mbarrier-wait protocol (a mirror of the control flow
# in kernel.cuh: run_steps(), the refill masks of config.h, the prologues). Not a test of the compiled
# code: re-run it (python3 protocol_model.py) after changing the schedule, and keep it in sync.
# Checks for sequences of requests with arbitrary block counts:
#  - every block is loaded exactly once per piece, into stage b % 2, and waited exactly once per piece
#  - the parity a warpgroup waits with equals the number of completed phases of that barrier mod 2
#  - a refill of a piece is issued only after the previous block in that stage+piece was consumed
#    (its last reader finished), and no phase is ever more than one ahead of its waiter
import itertools, random

REFILL = {(0, 0): 0x00F, (0, 1): 0x1F0, (1, 0): 0x10F, (1, 1): 0x0F0}
PIECES = range(9)

def steps(nblk):
    out = []; b0 = 0
    while b0 + 4 <= nblk:
        out.append((True, True, True, b0)); b0 += 2
    rem = nblk - b0
    if rem == 3: out += [(True, True, False, b0), (False, False, False, b0 + 2)]
    elif rem == 2: out.append((True, False, False, b0))
    elif rem == 1: out.append((False, False, False, b0))
    return out

def run(requests):
    # barrier state per (stage, piece): completed phases, pending load block (or None)
    completed = {(s, j): 0 for s in (0, 1) for j in PIECES}
    pending = {(s, j): None for s in (0, 1) for j in PIECES}
    last_consumed = {(s, j): None for s in (0, 1) for j in PIECES}
    parity = [0, 0]  # WG0 -> stage 0, WG1 -> stage 1
    def load(s, j, blk, req):
        assert pending[(s, j)] is None, f"second load in flight on stage {s} piece {j}"
        assert blk % 2 == s
        # previous block of this stage must be consumed (or this is a request's first load of the stage)
        prev = blk - 2
        if prev >= 0:
            assert last_consumed[(s, j)] == (req, prev), f"refill of {blk} before {prev} consumed ({s},{j})"
        pending[(s, j)] = (req, blk)
        # TMA completes eventually: model as completing immediately
        completed[(s, j)] += 1
    def wait(wg, s, pieces, blk, req):
        assert wg == s
        for j in pieces:
            assert pending[(s, j)] == (req, blk), f"wait for {blk} but pending {pending[(s,j)]} ({s},{j})"
            # try_wait.parity(P) returns once phase with parity P completed: completed phases count must be
            # odd when P=0 ... i.e. completed % 2 == (P + 1) % 2 and no further phase pending
            assert completed[(s, j)] % 2 == (parity[s] + 1) % 2, "parity mismatch"
    def consume(s, pieces, blk, req):
        for j in pieces:
            pending[(s, j)] = None
            last_consumed[(s, j)] = (req, blk)
    mask = lambda m: [j for j in PIECES if (m >> j) & 1]
    for req, nblk in enumerate(requests):
        # request loads (after the previous request's __syncthreads)
        for (s, j), v in pending.items(): assert v is None, "load left over from previous request"
        last_consumed = {k: None for k in last_consumed}
        if nblk > 0:
            for j in PIECES: load(0, j, 0, req)
        if nblk > 1:
            for j in PIECES: load(1, j, 1, req)
        if nblk == 0: continue
        # WG0 prologue / WG1 prologue
        wait(0, 0, PIECES, 0, req); parity[0] ^= 1
        consumed_qk = {0}
        if nblk > 1:
            wait(1, 1, PIECES, 1, req); parity[1] ^= 1
        # The two warpgroups interleave; model the order of events that the named barriers enforce.
        for has1, next0, next1, b0 in steps(nblk):
            assert has1 == (b0 + 1 < nblk) and next0 == (b0 + 2 < nblk) and next1 == (b0 + 3 < nblk)
            # WG0 P0V0L done -> refill stage 0 L ; WG1 P0V0R done -> refill stage 0 R (incl. P0 piece)
            consume(0, range(9), b0, req)  # all readers of block b0 done by the end of both refills
            if next0:
                for j in mask(REFILL[(0, 0)]): load(0, j, b0 + 2, req)
                for j in mask(REFILL[(0, 1)]): load(0, j, b0 + 2, req)
            if has1:
                consume(1, range(9), b0 + 1, req)
                if next1:
                    for j in mask(REFILL[(1, 1)]): load(1, j, b0 + 3, req)   # WG1 after P1V1R
                    for j in mask(REFILL[(1, 0)]): load(1, j, b0 + 3, req)   # WG0 after P1V1L
            if next0:
                wait(0, 0, [0, 1, 2, 3], b0 + 2, req); wait(0, 0, [4, 5, 6, 7, 8], b0 + 2, req); parity[0] ^= 1
            if next1:
                wait(1, 1, [4, 5, 6, 7, 0, 1, 2, 3, 8], b0 + 3, req); parity[1] ^= 1
        for (s, j), v in pending.items(): assert v is None, f"load never consumed {v}"
    return True

for n in range(0, 40): run([n])
for seq in itertools.product(range(0, 7), repeat=3): run(list(seq))
random.seed(0)
for _ in range(2000): run([random.choice([0, 1, 2, 3, 4, 5, 64, 65, 127]) for _ in range(random.randint(1, 8))])
print("protocol model: all request sequences consistent")
