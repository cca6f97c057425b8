"""Randomised model of the barrier protocols of the warp-specialised sm_90a kernels.

src/cuda/sm90/sm90_fwd_ws.cuh, sm90_dq_ws.cuh and sm90_bwd_ws.cuh (dK/dV) hand K/V (or Q/dO) blocks
from a producer to two consumer warpgroups through mbarrier rings; the forward and the dQ kernel
also alternate the consumers' GEMM issue with two named barriers. This model replays each kernel's
sequence of waits and arrivals (mbarrier phases and parities, copies landing asynchronously,
cp.async arrivals, named-barrier counts) under random interleavings and checks: no deadlock, every
consumer read sees the block it expects, no stage is overwritten while a consumer reads it, no
named barrier is left half-arrived. It does not run the kernels; keep it in step with them.
run_dkdv512 models the D = 512 dK/dV and dQ kernels (2-CTA clusters, partials pushed with st.async,
exchange buffers reused for the slices, the xfree barrier); injected_bugs_caught checks that each
of four injected errors is caught.
run_fwd512c models the D = 512 cluster forward (split head dim, the half exchange per block and
warpgroup: the other row's partial S, then the own row's P words taken in the next turn, each with
its full / free barriers of 4 warp arrivals; ping-pong; the rows' max and sum after the walk);
fwd512c_bugs_caught injects six errors into it. run_d256 models the D = 256 warp-specialised
dK/dV kernel (P^T / dS^T swaps between its two consumer warpgroups through single buffers and
named barriers 1, 2); d256_bugs_caught injects three errors into it.

    python3 tests/cuda/ws_protocol_sim.py
"""

import random


class MBar:
    def __init__(s, count):
        s.count, s.pending, s.phase, s.tx = count, count, 0, 0

    def arrive(s):
        s.pending -= 1
        s._chk()

    def expect_tx(s, n):
        s.tx += n
        s.arrive()

    def complete_tx(s, n):
        s.tx -= n
        s._chk()

    def _chk(s):
        assert s.pending >= 0
        if s.pending == 0 and s.tx == 0:
            s.phase += 1
            s.pending = s.count

    def done(s, parity):  # the phase of this parity has completed (PTX try_wait.parity)
        return (s.phase & 1) != parity


class Named:
    """A named barrier (bar.sync / bar.arrive) over n parties."""

    def __init__(s, n):
        s.n, s.cnt, s.gen = n, 0, 0

    def arrive(s):
        s.cnt += 1
        assert s.cnt <= s.n
        if s.cnt == s.n:
            s.cnt, s.gen = 0, s.gen + 1

    def sync(s):  # generator: arrive, then wait for the barrier's completion
        gen = s.gen
        s.arrive()
        while s.gen == gen:
            yield


class NamedPair(Named):
    """A named barrier of two warpgroups that must be two different ones: in hardware it counts
    threads, so two arrivals of one warpgroup would complete a generation alone."""

    def __init__(s):
        super().__init__(2)
        s.who = []

    def arrive(s, who=None):
        assert who not in s.who, f"warpgroup {who} arrived twice in one generation"
        s.who.append(who)
        super().arrive()
        if s.cnt == 0:
            s.who = []

    def sync(s, who=None):
        gen = s.gen
        s.arrive(who)
        while s.gen == gen:
            yield


def wait(bar, par):
    """Generator: spins until the mbarrier phase of parity `par` has completed."""
    while not bar.done(par):
        yield


def schedule(threads, inflight, land, rng, what):
    """Runs the threads (generators) and lands the in-flight copies (land(item)) in a random
    interleaving until all are done; a schedule that makes no progress is a deadlock."""
    alive = list(threads)
    steps = 0
    while alive or inflight:
        steps += 1
        if steps > 100000:
            raise RuntimeError(f"deadlock {what}")
        if inflight and rng.random() < 0.3:
            land(inflight.pop(rng.randrange(len(inflight))))
            continue
        if not alive:
            continue
        t = rng.choice(alive)
        try:
            next(t)
        except StopIteration:
            alive.remove(t)


def run_fwd(total, S, pp, rng, nc=2, bug=None):
    """The forward with nc consumer warpgroups (2, or 3: the D = 64 forward on 192-row tiles),
    taking turns in the order 0, 1, .., nc - 1 (PingPong<NC, NW>: warpgroup cw syncs on barrier
    1 + cw, which the warpgroup before it arrives on). bug: "no_finish" (warpgroup 0 does not take
    the last hand-over), "start_by_1" (warpgroup 1, not the last one, lets warpgroup 0 go first),
    "next_is_prev" (a warpgroup hands its turn to the one before it)."""
    bQ = MBar(1)
    fk = [MBar(1) for _ in range(S)]
    fv = [MBar(1) for _ in range(S)]
    ek = [MBar(nc) for _ in range(S)]
    ev = [MBar(nc) for _ in range(S)]
    slotk = [None] * S
    slotv = [None] * S
    readers_k = [set() for _ in range(S)]
    readers_v = [set() for _ in range(S)]
    inflight = []  # (bar, stage slot, value, kind)
    bars = {1 + c: NamedPair() for c in range(nc)}  # each joins two warpgroups
    issuing = set()  # the warpgroups between begin_turn and end_turn

    def turn(cw):  # generator: a GEMM issue, alone when ping-pong is on
        if pp:
            yield from bars[1 + cw].sync(cw)
            assert not issuing, f"warpgroups {issuing} and {cw} issue at once"
        issuing.add(cw)
        yield
        issuing.discard(cw)

    def producer():
        bQ.expect_tx(1)
        inflight.append((bQ, None, None, "q"))
        for j in range(total):
            s = j % S
            ph = (j // S) & 1
            yield from wait(ek[s], ph ^ 1)
            assert not readers_k[s], "K overwritten while read"
            fk[s].expect_tx(1)
            inflight.append((fk[s], s, j, "k"))
            yield from wait(ev[s], ph ^ 1)
            assert not readers_v[s], "V overwritten while read"
            fv[s].expect_tx(1)
            inflight.append((fv[s], s, j, "v"))

    def consumer(cw):
        my, other = 1 + cw, 1 + (cw + (nc - 1 if bug == "next_is_prev" else 1)) % nc
        if pp and cw == (1 if bug == "start_by_1" else nc - 1):
            bars[other].arrive(cw)
        yield from wait(bQ, 0)
        if total > 0:
            yield from wait(fk[0], 0)
            assert slotk[0] == 0
            yield from turn(cw)
            readers_k[0].add(cw)
            if pp:
                bars[other].arrive(cw)
            yield
            readers_k[0].discard(cw)
            ek[0].arrive()
            for j in range(1, total):
                st, pst = j % S, (j - 1) % S
                yield from wait(fk[st], (j // S) & 1)
                yield from wait(fv[pst], ((j - 1) // S) & 1)
                assert slotk[st] == j and slotv[pst] == j - 1, (slotk, slotv, j)
                yield from turn(cw)
                readers_k[st].add(cw)
                readers_v[pst].add(cw)
                if pp:
                    bars[other].arrive(cw)
                yield
                readers_k[st].discard(cw)
                ek[st].arrive()
                yield
                readers_v[pst].discard(cw)
                ev[pst].arrive()
            lst = (total - 1) % S
            yield from wait(fv[lst], ((total - 1) // S) & 1)
            assert slotv[lst] == total - 1
            yield from turn(cw)
            readers_v[lst].add(cw)
            if pp:
                bars[other].arrive(cw)
            yield
            readers_v[lst].discard(cw)
        if pp and cw == 0 and bug != "no_finish":
            yield from bars[my].sync(cw)

    def land(x):
        bar, s, v, kind = x
        if kind == "k":
            slotk[s] = v
        if kind == "v":
            slotv[s] = v
        bar.complete_tx(1)

    schedule([producer()] + [consumer(c) for c in range(nc)], inflight, land, rng, "fwd")
    for b in bars.values():
        assert b.cnt == 0, "named barrier left half-arrived"


def run_dq(total, S, pp, rng):
    bQ = MBar(1)
    full = [MBar(1) for _ in range(S)]
    empty = [MBar(2) for _ in range(S)]
    slot = [None] * S
    readers = [set() for _ in range(S)]
    inflight = []
    bars = {1: Named(2), 2: Named(2)}  # counts in warpgroups

    def producer():
        bQ.expect_tx(1)
        inflight.append((bQ, None, None))
        for j in range(total):
            s = j % S
            yield from wait(empty[s], ((j // S) & 1) ^ 1)
            assert not readers[s]
            full[s].expect_tx(1)
            inflight.append((full[s], s, j))

    def consumer(cw):
        # Turns: (S_0, dP_0), (dQ_0, S_1, dP_1), ..., (dQ_{total-1}); stage j is read by S_j,
        # dP_j and dQ_j, and released after the wait that retires dQ_j (in block j + 1).
        my, other = 1 + cw, 2 - cw
        if pp and cw == 1:
            bars[other].arrive()
        yield from wait(bQ, 0)
        for j in range(total + (total > 0)):
            if j < total:
                st = j % S
                yield from wait(full[st], (j // S) & 1)
                assert slot[st] == j
            if pp:
                yield from bars[my].sync()
            if j > 0:
                assert cw in readers[(j - 1) % S], "dQ reads a released stage"
            if j < total:
                readers[st].add(cw)
            if pp:
                bars[other].arrive()
            yield
            if 0 < j < total:
                readers[(j - 1) % S].discard(cw)
                empty[(j - 1) % S].arrive()
            yield
        if pp and cw == 0:
            yield from bars[my].sync()

    def land(x):
        bar, s, v = x
        if s is not None:
            slot[s] = v
        bar.complete_tx(1)

    schedule([producer(), consumer(0), consumer(1)], inflight, land, rng, "dq")
    for b in bars.values():
        assert b.cnt == 0, "named barrier left half-arrived"


def dkdv_producer_lane(ln, S, nblocks, bKV, full, empty, meta, inflight, busy):
    """Lane ln of the dK/dV kernels' producer warp: K/V once (lane 0), then per query block of the
    walk the stage's TMA (lane 0: its record, expect_tx) and every lane's cp.async of lse/delta
    (arrive.noinc, lands later), through the S-deep ring; the end record after the walk.
    busy(s): the stage is still being read (it must not be refilled)."""
    if ln == 0:
        bKV.expect_tx(1)
        inflight.append((bKV, None, None))
    it = 0
    while True:
        s = it % S
        yield from wait(empty[s], ((it // S) & 1) ^ 1)
        if it == nblocks:
            if ln == 0:
                meta[s] = "end"
                full[s].arrive()
            full[s].arrive()
            return
        if ln == 0:
            assert not busy(s), "stage refilled while read"
            meta[s] = it
            full[s].expect_tx(1)
            inflight.append((full[s], s, it))
        inflight.append(("cp", full[s], None))
        it += 1
        yield


def run_dkdv(nblocks, S, rng, dq_mode=0, nbuf=1, onered=False, bug=None, d64=False):
    # full count: 1 (expect_tx lane) + 32 (cp.async lanes), modelled as 1 + L lanes.
    # dq_mode 1, 2 (deleted kernel modes; 5 is today's kFusedDq): each consumer writes its dS^T
    # half into buffer it & 1, named barrier 1 (both warpgroups), both read both halves (the dQ
    # product) until their wgmma wait; the dK product reads its own half and the stage until the
    # next block's first wait, which then releases the stage (after the loop: a final wait and
    # release).
    # 2: then the consumer hands its dQ block to its reducer warp (dq_full[c],
    # dq_empty[c], a record with an end marker); the reducer's bulk reads end at its
    # wait_group.read. 4: the same protocol (only the stores' layout differs).
    # 3 and 5 (FA3's order): the dK product reads dS^T from registers and the stage; the consumer
    # retires dQ (its reads of both dS halves), hands the dQ block over, then retires dK and
    # releases the stage within the block (no deferred release).
    # The deleted DUALKV_SM90_BWD_VARIANT kernels (kVar, with dq_mode 5; measured slower than the
    # default, 2026-12-01; modelled still, as modes 1, 2, 4 are): nbuf = 2 (bit 0): two dQ buffers
    # per warpgroup, block it in buffer it % 2 with parity (it // 2) & 1 on its own dq_full/dq_empty
    # (and the kernel's STAGES = 2); onered (bit 1, D = 64): warpgroup 1 stores its partial into the
    # exchange buffer (warpgroup 1's dQ buffer 0) once x_free says warpgroup 0 has read the previous
    # one, arrives on x_full; warpgroup 0 waits x_full, reads and adds it, arrives on x_free, then
    # hands the sum to reducer 0; reducer 1 does not run, and only warpgroup 0 sends the end record.
    # bug: an injected error (variant_bugs_caught). d64 (with dq_mode 5; onered implies it): D =
    # 64's dQ split by keys, no named barrier joining the warpgroups.
    d64 = d64 or onered
    assert not d64 or dq_mode == 5
    handoff = dq_mode >= 2
    defer = dq_mode in (1, 2, 4)  # 5: mode 3's protocol (an L2 hint on the reductions)
    L = 3
    bKV = MBar(1)
    full = [MBar(1 + L) for _ in range(S)]
    empty = [MBar(2) for _ in range(S)]
    meta = [None] * S
    slot = [None] * S
    readers = [set() for _ in range(S)]
    inflight = []
    ds_slot = [[None, None], [None, None]]  # [buffer][half]
    ds_readers = [set(), set()]
    dk_readers = [set(), set()]  # [buffer]: warpgroups whose dK still reads their half
    bar1 = Named(2)
    # [warpgroup][buffer]; count 128 (a warpgroup) modelled as 1 / count 1 (the reducer lane)
    dq_full = [[MBar(1) for _ in range(nbuf)] for _ in range(2)]
    dq_empty = [[MBar(1) for _ in range(nbuf)] for _ in range(2)]
    dq_buf = {}  # (warpgroup, buffer) -> what it holds; also the onered exchange buffer
    dq_meta = {}
    dq_reading = {}
    reduced = [[], []]
    x_full, x_free = MBar(1), MBar(1)  # onered; counts 128 (a warpgroup) modelled as 1
    xkey = (0, 0) if bug == "x_alias" else (1, 0)  # the exchange buffer
    x_reading = [False]

    def dq_buffer(it):  # (buffer, parity of its full barrier) of block it
        if bug == "one_parity":
            return it % nbuf, it & 1
        return it % nbuf, (it // nbuf) & 1

    def reducer(c):
        it = 0
        while True:
            b, par = dq_buffer(it)
            if bug == "reducer_buf0":
                b = 0
            yield from wait(dq_full[c][b], par)
            if dq_meta.get((c, b)) == "end":
                return
            want = ("sum", it) if onered else it
            assert dq_meta.get((c, b)) == it and dq_buf.get((c, b)) == want, (c, b, it)
            dq_reading[(c, b)] = True
            yield  # bulk reductions read the buffer
            assert dq_buf.get((c, b)) == want, "dQ buffer overwritten while reduced"
            dq_reading[(c, b)] = False
            reduced[c].append(it)
            dq_empty[c][b].arrive()
            it += 1

    def lane(ln):
        return dkdv_producer_lane(
            ln, S, nblocks, bKV, full, empty, meta, inflight, lambda s: bool(readers[s])
        )

    def consumer(cw):
        yield from wait(bKV, 0)
        it = 0
        pending = None  # dq_mode: (stage, dS buffer) the previous block's dK still reads

        def release():
            ps, pb = pending
            readers[ps].discard(cw)
            dk_readers[pb].discard(cw)
            empty[ps].arrive()

        while True:
            s = it % S
            yield from wait(full[s], (it // S) & 1)
            if meta[s] == "end":
                break
            assert meta[s] == it and slot[s] == it, (meta[s], slot[s], it)
            readers[s].add(cw)
            yield  # S, dP issued; the first wait retires the previous block's dK
            if pending:
                release()
                pending = None
            b = it & 1
            if dq_mode and d64:
                # D = 64: each warpgroup's dQ reads its own dS^T half only (named barrier 2 + c
                # of its own warpgroup: no join of the two warpgroups).
                assert cw not in dk_readers[b], "own dS half overwritten while dK reads it"
                ds_slot[b][cw] = it
                ds_readers[b].add(cw)
                yield  # the dQ wgmma reads the own half
                assert ds_slot[b][cw] == it, (ds_slot[b], it)
                ds_readers[b].discard(cw)
            elif dq_mode:
                assert not ds_readers[b], "dS buffer overwritten while read"
                assert cw not in dk_readers[b], "own dS half overwritten while dK reads it"
                ds_slot[b][cw] = it
                yield from bar1.sync()
                assert ds_slot[b] == [it, it], (ds_slot[b], it)
                ds_readers[b].add(cw)
                if defer:
                    dk_readers[b].add(cw)
                yield  # the dQ wgmma reads both halves
                ds_readers[b].discard(cw)
                if defer:
                    pending = (s, b)
            else:
                readers[s].discard(cw)
                empty[s].arrive()
            hand = handoff
            if handoff and onered:
                if cw == 1:
                    if bug != "no_x_free":
                        yield from wait(x_free, (it & 1) ^ 1)
                    assert not x_reading[0], "exchange buffer overwritten while read"
                    assert not dq_reading.get(xkey), "dQ buffer overwritten while reduced"
                    dq_buf[xkey] = ("x", it)
                    x_full.arrive()
                    hand = False
                else:
                    if bug != "no_x_full":
                        yield from wait(x_full, it & 1)
                    if bug == "early_x_free":
                        x_free.arrive()
                    assert dq_buf.get(xkey) == ("x", it), (dq_buf.get(xkey), it)
                    x_reading[0] = True
                    yield  # the loads of warpgroup 1's partial
                    assert dq_buf.get(xkey) == ("x", it), "exchange overwritten while read"
                    x_reading[0] = False
                    if bug != "early_x_free":
                        x_free.arrive()
            if hand:
                b, par = dq_buffer(it)
                yield from wait(dq_empty[cw][b], par ^ 1)
                assert not dq_reading.get((cw, b)), "dQ buffer overwritten while reduced"
                dq_buf[(cw, b)] = ("sum", it) if onered else it
                dq_meta[(cw, b)] = it
                dq_full[cw][b].arrive()
            if not defer and dq_mode:
                yield  # dK (dS^T from registers) still reads the stage until the final wait
                readers[s].discard(cw)
                empty[s].arrive()
            it += 1
        if pending:
            release()
        if handoff and not (onered and cw == 1):
            b, par = dq_buffer(it)
            if bug == "end_buf0":
                b = 0
            yield from wait(dq_empty[cw][b], par ^ 1)
            dq_meta[(cw, b)] = "end"
            dq_full[cw][b].arrive()

    def land(x):
        if x[0] == "cp":  # a cp.async arrival
            x[1].arrive()
            return
        bar, s, v = x
        if s is not None:
            slot[s] = v
        bar.complete_tx(1)

    ths = [lane(i) for i in range(L)] + [consumer(0), consumer(1)]
    if handoff:
        ths += [reducer(0)] if onered else [reducer(0), reducer(1)]
    schedule(ths, inflight, land, rng, f"dkdv (dq_mode {dq_mode}, nbuf {nbuf}, onered {onered})")
    if handoff:
        want = [list(range(nblocks)), [] if onered else list(range(nblocks))]
        assert reduced == want, reduced
    assert bar1.cnt == 0, "named barrier left half-arrived"


def run_dkdv512(nblocks, S, rng, bug=None, dq=False, sv=0):
    """The D = 512 dK/dV kernel (sm90_bwd512_ws.cuh): two CTAs of a cluster, each with its own
    producer ring (as run_dkdv), and per block and consumer warpgroup w: arm xfull[w] (local
    arrive.expect_tx), wait the local xfree barrier (the peer's 8 warps, modelled as its 2
    warpgroups, arrive after reading the previous block's slices), push the S^T and dP^T partials
    to the peer's X[w] with st.async (two pieces landing asynchronously, completing the peer's
    xfull[w]), wait the own xfull[w], read the peer's partials, write the slices into the own X[w],
    named barrier 1 of both warpgroups, read both warpgroups' slices, arrive on the peer's xfree;
    at the end a cluster barrier of every thread of both CTAs.
    dq: the D = 512 dQ kernel instead (one producer thread, Q/dO once, K/V blocks, no records:
    the consumers know the walk's length), whose warpgroups split each block's keys: no slices
    and no named barrier in the loop; each warpgroup frees its X[w] as soon as it has read the
    peer's partials, on a barrier of its own (xfree[w]); after the loop named barrier 1, both
    warpgroups' dQ halves through the K ring (nothing may still read or fill it), named barrier 1
    again, the halves read back.
    Both kernels defer products (kPipe): block j's dV/dK (dQ) products are issued behind block
    j + 1's partial products and read block j's stage until they complete, which is waited for
    after block j + 1's partials are sent; only then is block j's stage released (the last
    block's products run after the loop). And both have the half exchange: besides the partials,
    each CTA sends its slices of block j (dQ: dS; dK/dV: P^T and dS^T) to the peer's XD[w]
    (st.async completing xfull_d[w], once the peer has read block j - 1's: xfree_d[w]); the peer
    waits for them in block j + 1 before the deferred products, frees XD[w] and arms xfull_d[w]
    for block j + 1 (block 0's phase at the start, the last block's slices after the loop). (The
    xfree_d wait is also implied by the order: the peer sends block j + 1's slice only after this
    CTA's block j + 1 partials, which follow its receipt of block j's slice; the model finds no
    schedule that needs it.)
    sv (dq only): V on a separate ring of sv stages (the kernel's: K on the S-stage ring, V on one
    stage), each tile on its own full / empty barriers; the consumers release V_j once block j's
    dP has read it (after the partials' waits), K_j after its dQ product.
    bug: None, or an injected protocol error that the checks must catch."""
    if bug == "pipe_one_stage":
        S = 1
    keysplit = dq
    nread = 1 if dq else 2  # warpgroups that read each remote slice word (half)
    C, L = 2, 1 if dq else 3
    bKV = [MBar(1) for _ in range(C)]
    full = [[MBar(1 if dq else 1 + L) for _ in range(S)] for _ in range(C)]
    empty = [[MBar(2) for _ in range(S)] for _ in range(C)]
    meta = [[None] * S for _ in range(C)]
    slot = [[None] * S for _ in range(C)]
    readers = [[set() for _ in range(S)] for _ in range(C)]
    full_v = [[MBar(1) for _ in range(sv)] for _ in range(C)]
    empty_v = [[MBar(2) for _ in range(sv)] for _ in range(C)]
    slot_v = [[None] * sv for _ in range(C)]
    readers_v = [[set() for _ in range(sv)] for _ in range(C)]
    xfull = [[MBar(1) for _ in range(2)] for _ in range(C)]
    xfree = [MBar(1 if bug == "xfree_one_warpgroup" else 2) for _ in range(C)]
    xfree_w = [[MBar(1) for _ in range(2)] for _ in range(C)]  # keysplit: one per warpgroup
    xfull_d = [[MBar(1) for _ in range(2)] for _ in range(C)]  # the peer's slices
    xfree_d = [[MBar(nread) for _ in range(2)] for _ in range(C)]
    xd = [[None] * 2 for _ in range(C)]  # the block whose slices XD[w] holds
    xd_readers = [[set(), set()] for _ in range(C)]
    # X[cta][w]: state "free" -> "partial" (pieces landing) -> "read" -> "slice" (being read)
    xstate = [["free"] * 2 for _ in range(C)]
    xblock = [[None] * 2 for _ in range(C)]
    xparts = [[set() for _ in range(2)] for _ in range(C)]
    xslice_readers = [[set() for _ in range(2)] for _ in range(C)]
    bar1 = [Named(2) for _ in range(C)]
    cluster = Named(C * (L + 2))
    finished = [0] * C
    exited = [False] * C
    inflight = []

    def finish(c):
        finished[c] += 1
        exited[c] = finished[c] == L + 2

    def lane(c, ln):
        if ln == 0:
            bKV[c].expect_tx(1)
            inflight.append(("tma", c, bKV[c], None, None))
        it = 0
        while True:
            s = it % S
            if dq and it == nblocks:
                break
            yield from wait(empty[c][s], ((it // S) & 1) ^ 1)
            if it == nblocks:
                if ln == 0:
                    meta[c][s] = "end"
                    full[c][s].arrive()
                full[c][s].arrive()
                break
            if ln == 0:
                assert not readers[c][s], "stage overwritten while read"
                meta[c][s] = it
                full[c][s].expect_tx(1)
                inflight.append(("tma", c, full[c][s], s, it))
            if sv:
                t = it % sv
                yield from wait(empty_v[c][t], ((it // sv) & 1) ^ 1)
                assert not readers_v[c][t], "V stage overwritten while read"
                full_v[c][t].expect_tx(1)
                inflight.append(("tmav", c, full_v[c][t], t, it))
            if not dq:
                inflight.append(("cp", c, full[c][s], None, None))
            it += 1
            yield
        if bug != "no_final_cluster_barrier":
            yield from cluster.sync()
        finish(c)

    def products(c, w, s, blk, release=True):  # generator: dV/dK (dQ) of block blk from stage s
        yield
        assert slot[c][s] == blk, ("products read an overwritten stage", slot[c][s], blk)
        if release:
            readers[c][s].discard(w)
            empty[c][s].arrive()

    def consumer(c, w):
        peer = 1 - c

        def recv_ds(blk):  # the peer's slices of block blk (dQ: XD[w]; dK/dV: both)
            for w2 in [w] if dq else [0, 1]:
                if bug != "half_no_recv_wait":
                    yield from wait(xfull_d[c][w2], blk & 1)
                assert xd[c][w2] == blk, ("a slice read before it landed", xd[c][w2], blk)
                xd_readers[c][w2].add(w)
                yield
                if len(xd_readers[c][w2]) == nread:
                    xd[c][w2], xd_readers[c][w2] = None, set()
            for w2 in [w] if dq else [0, 1]:
                assert not exited[peer], "arrival on an exited CTA's barrier"
                xfree_d[peer][w2].arrive()

        yield from wait(bKV[c], 0)
        it = 0
        prev = None  # (stage, block) of the products still in flight
        while True:
            s = it % S
            if dq and it == nblocks:
                break
            yield from wait(full[c][s], (it // S) & 1)
            if not dq and meta[c][s] == "end":
                break
            assert (dq or meta[c][s] == it) and slot[c][s] == it, (meta[c][s], slot[c][s], it)
            readers[c][s].add(w)
            if sv:
                t = it % sv
                yield from wait(full_v[c][t], (it // sv) & 1)
                assert slot_v[c][t] == it, (slot_v[c][t], it)
                readers_v[c][t].add(w)
                if bug == "v_early_release":  # released at the products' issue, before dP's wait
                    readers_v[c][t].discard(w)
                    empty_v[c][t].arrive()
            xfull[c][w].expect_tx(2)  # this block's phase: the arm + the peer's two pieces
            if bug == "half_arm_early":  # armed before block it - 1's slice was received
                xfull_d[c][w].expect_tx(1)
            yield  # S^T and dP^T partials issued
            if prev is not None:  # the slice of block it - 1 before its deferred product
                yield from recv_ds(it - 1)
            if bug != "half_arm_early":
                xfull_d[c][w].expect_tx(1)  # block it's phase
            if bug != "no_xfree_wait":
                par = it & 1 if bug == "xfree_parity" else (it & 1) ^ 1
                yield from wait(xfree_w[c][w] if keysplit else xfree[c], par)
            if (
                keysplit and bug == "ks_early_free"
            ):  # X[w] freed before the peer's partials are read
                xfree_w[peer][w].arrive()

            def release_v(t, it):  # dP has read V (swap_add_pipe's b_done)
                yield
                assert slot_v[c][t] == it, ("dP read an overwritten V", slot_v[c][t], it)
                if bug != "v_early_release":
                    readers_v[c][t].discard(w)
                    empty_v[c][t].arrive()

            for piece in ("s", "dp"):
                yield  # wgmma wait, then st.async of this partial to the peer's X[w]
                if piece == "dp" and sv:  # dP has completed: V_j is free
                    yield from release_v(t, it)
                inflight.append(("x", peer, w, piece, it))
            if prev is not None:  # wait<0>: the previous block's products
                yield from products(c, w, *prev)
                prev = None
            yield from wait(xfull[c][w], it & 1)
            assert xstate[c][w] == "partial" and xblock[c][w] == it, (xstate[c][w], it)
            assert xparts[c][w] == {"s", "dp"}, "a partial read before it landed"
            xstate[c][w] = "read"
            if keysplit:
                xstate[c][w] = "free"
                if bug != "ks_early_free":
                    assert not exited[peer], "arrival on an exited CTA's barrier"
                    xfree_w[peer][w].arrive()
                yield  # P, dS: this warpgroup's own keys only
                yield from wait(xfree_d[c][w], (it & 1) ^ 1)
                inflight.append(("xd", peer, w, None, it))
                prev = (s, it)
                it += 1
                continue
            yield  # P, dS
            yield from wait(xfree_d[c][w], (it & 1) ^ 1)  # this CTA's slices to the peer
            inflight.append(("xd", peer, w, None, it))
            xstate[c][w] = "slice"
            xslice_readers[c][w] = set()
            yield from bar1[c].sync()
            for v in (0, 1):
                assert xstate[c][v] == "slice" and xblock[c][v] == it, (xstate[c][v], it)
                xslice_readers[c][v].add(w)
                yield
                if xslice_readers[c][v] == {0, 1}:
                    xstate[c][v] = "free"
            assert not exited[peer], "arrival on an exited CTA's barrier"
            xfree[peer].arrive()
            if bug == "pipe_early_release":  # released here, products still pending
                readers[c][s].discard(w)
                empty[c][s].arrive()
                prev = (s, it, False)
            else:
                prev = (s, it)
            it += 1
        if prev is not None:  # the last block's products
            yield from recv_ds(prev[1])
            yield from products(c, w, *prev)
        if keysplit:  # the two warpgroups' dQ halves meet in the K ring
            if bug != "ks_no_reduce_barrier":
                yield from bar1[c].sync()
            assert not any(readers[c]), "the K ring reused while a product reads it"
            assert not any(x[0] == "tma" and x[1] == c for x in inflight), "a load into the K ring"
            yield
            yield from bar1[c].sync()
            yield
        if bug != "no_final_cluster_barrier":
            yield from cluster.sync()
        finish(c)

    def land(x):
        kind, c, a, b, v = x
        assert not exited[c], "a write landing in an exited CTA"
        if kind == "cp":
            a.arrive()
        elif kind == "tma":
            if b is not None:
                slot[c][b] = v
            a.complete_tx(1)
        elif kind == "tmav":
            slot_v[c][b] = v
            a.complete_tx(1)
        elif kind == "xd":  # a dS slice of block v into XD[a] of CTA c
            assert xd[c][a] is None, ("a slice overwritten before it was read", xd[c][a], v)
            xd[c][a] = v
            xfull_d[c][a].complete_tx(1)
        else:  # st.async piece b of block v into X[a] of CTA c
            if xstate[c][a] == "free":
                xstate[c][a], xblock[c][a], xparts[c][a] = "partial", v, set()
            assert xstate[c][a] == "partial" and xblock[c][a] == v, (
                "exchange buffer overwritten while in use",
                xstate[c][a],
                xblock[c][a],
                v,
            )
            xparts[c][a].add(b)
            xfull[c][a].complete_tx(1)

    ths = [lane(c, i) for c in range(C) for i in range(L)]
    ths += [consumer(c, w) for c in range(C) for w in (0, 1)]
    schedule(ths, inflight, land, rng, f"{'dq' if dq else 'dkdv'}512 ({bug})")
    if bug != "no_final_cluster_barrier":
        assert all(exited)
    assert all(b.cnt == 0 for b in bar1) and cluster.cnt == 0, "barrier left half-arrived"


def bugs_caught(bugs, run_one, tries=400):
    """Each injected bug must make some of `tries` random schedules fail (run_one(bug, i) runs
    schedule i with it); returns how many bugs were checked."""
    for bug in bugs:
        for i in range(tries):
            try:
                run_one(bug, i)
            except (AssertionError, RuntimeError):
                break
        else:
            raise AssertionError(f"injected bug {bug} was not caught")
    return len(bugs)


def injected_bugs_caught(rng):
    """Each injected error of the D = 512 dK/dV protocol must be caught by some schedule."""

    def run_one(bug, i):
        dq = i % 2 == 1 and bug != "xfree_one_warpgroup"  # the dQ kernel's xfree[w]
        run_dkdv512(rng.randrange(1, 6), rng.choice([2, 3]), rng, bug, dq=dq, sv=int(dq))

    bugs = ("no_xfree_wait", "xfree_one_warpgroup", "xfree_parity", "no_final_cluster_barrier")
    return bugs_caught(bugs, run_one)


def pipe_bugs_caught(rng):
    """Each injected error of the kPipe order must be caught: the previous block's stage released
    before its deferred products ran, a ring of one stage (the consumer holds two), and (the dQ
    kernel's V ring) V released before block j's dP has read it."""

    def run_one(bug, i):
        dq = i % 2 == 1 or bug == "v_early_release"
        run_dkdv512(rng.randrange(2, 7), 2, rng, bug, dq=dq, sv=int(dq))

    return bugs_caught(("pipe_early_release", "pipe_one_stage", "v_early_release"), run_one)


def keysplit_bugs_caught(rng):
    """Each injected error of the dQ kernel's key split and of the half exchange (both kernels)
    must be caught: X[w] freed before the peer's partials are read, the K ring reused for the dQ
    halves without the barrier that waits for both warpgroups' last products, the peer's slices
    read without waiting for them, and their barrier armed for the next block before the previous
    block's phase completed."""

    def run_one(bug, _):
        dq = bug.startswith("ks") or rng.random() < 0.5  # the half exchange: both kernels
        run_dkdv512(rng.randrange(1, 7), 3, rng, bug, dq=dq, sv=int(dq))

    bugs = ("ks_early_free", "ks_no_reduce_barrier", "half_no_recv_wait", "half_arm_early")
    return bugs_caught(bugs, run_one)


def run_fwd512c(total, S, rng, pp=True, bug=None):
    """The D = 512 cluster forward (sm90_fwd512_cluster.cuh): two CTAs of a cluster, each with its
    own producer ring (its half of Q once, then its half of every K/V block, local full / empty
    barriers as run_fwd), two consumer warpgroups on different rows with ping-pong, and per block
    and warpgroup w the half exchange with warpgroup w of the peer (FwdD512HalfExchange):
    partials: arm xfull[w] (local arrive.expect_tx), wait the local xfree[w] (parity of the
    previous block), push the other row's partial with st.async into the peer's X[w] (landing
    asynchronously, completing the peer's xfull[w]), wait the own xfull[w], then each of the 4
    warps reads and arrives on the peer's xfree[w] (count 4); after the softmax the P words: arm
    xfull_p[w], wait xfree_p[w], push; they are taken in the next turn (after S_{j+1} is issued,
    before P_j V_j): wait xfull_p[w], each warp reads and arrives on the peer's xfree_p[w]. After
    the walk the rows' max and sum go through the same words (phase `total` of xfull_p: arm, wait
    xfree_p, push, wait, read). At the end a cluster barrier of every thread of both CTAs.
    bug: None, or an injected protocol error that the checks must catch."""
    C, W = 2, 4  # CTAs, warps per consumer warpgroup
    bQ = [MBar(1) for _ in range(C)]
    fk = [[MBar(1) for _ in range(S)] for _ in range(C)]
    fv = [[MBar(1) for _ in range(S)] for _ in range(C)]
    ek = [[MBar(2) for _ in range(S)] for _ in range(C)]
    ev = [[MBar(2) for _ in range(S)] for _ in range(C)]
    slotk = [[None] * S for _ in range(C)]
    slotv = [[None] * S for _ in range(C)]
    readers_k = [[set() for _ in range(S)] for _ in range(C)]
    readers_v = [[set() for _ in range(S)] for _ in range(C)]
    bars = [{1: Named(2), 2: Named(2)} for _ in range(C)]
    nfree = 1 if bug == "xfree_count_one" else W
    # X[cta][w] has two regions, each with its barriers: "x" the partial, "p" the P words (and
    # the final max / sum). state: "free" -> (block) landed -> read by the 4 warps -> "free"
    full = {r: [[MBar(1) for _ in range(2)] for _ in range(C)] for r in "xp"}
    free = {r: [[MBar(nfree) for _ in range(2)] for _ in range(C)] for r in "xp"}
    state = {r: [[None] * 2 for _ in range(C)] for r in "xp"}
    nread = {r: [[set() for _ in range(2)] for _ in range(C)] for r in "xp"}
    cluster = Named(C * 3)  # per CTA: the producer and the two consumer warpgroups
    finished = [0] * C
    exited = [False] * C
    inflight = []  # (kind, cta, bar, slot, value)

    def finish(c):
        finished[c] += 1
        exited[c] = finished[c] == 3

    def producer(c):
        bQ[c].expect_tx(1)
        inflight.append(("q", c, bQ[c], None, None))
        for j in range(total):
            st, ph = j % S, (j // S) & 1
            yield from wait(ek[c][st], ph ^ 1)
            assert not readers_k[c][st], "K overwritten while read"
            fk[c][st].expect_tx(1)
            inflight.append(("k", c, fk[c][st], st, j))
            yield from wait(ev[c][st], ph ^ 1)
            assert not readers_v[c][st], "V overwritten while read"
            fv[c][st].expect_tx(1)
            inflight.append(("v", c, fv[c][st], st, j))
        if bug != "no_final_cluster_barrier":
            yield from cluster.sync()
        finish(c)

    def send(r, c, w, j, wait_free=True):
        """Arm this CTA's phase j of region r, wait until the peer has read phase j - 1, push."""
        peer = 1 - c
        if not (bug == "no_arm" and r == "x") and not (bug == "no_p_arm" and r == "p"):
            full[r][c][w].expect_tx(1)
        if wait_free and not (bug == "no_xfree_wait" and r == "x"):
            par = j & 1 if bug == "xfree_parity" and r == "x" else (j & 1) ^ 1
            yield from wait(free[r][c][w], par)
        if bug == "wait_before_send" and r == "x":  # both CTAs wait for the other's first
            yield from wait(full[r][c][w], j & 1)
        assert not exited[peer], "st.async into an exited CTA"
        inflight.append(("x" + r, peer, w, None, j))

    def receive(r, c, w, j, release=True):
        """Wait for the peer's phase j of region r, read it (each warp), free it."""
        peer = 1 - c
        yield from wait(full[r][c][w], j & 1)
        assert state[r][c][w] == j, ("read before landing", r, state[r][c][w], j)
        for k in range(W):  # each warp reads its words, then arrives on the peer's barrier
            yield
            nread[r][c][w].add(k)
            if len(nread[r][c][w]) == W:
                state[r][c][w], nread[r][c][w] = None, set()
            if release:
                assert not exited[peer], "arrival on an exited CTA's barrier"
                free[r][peer][w].arrive()

    def consumer(c, w):
        my, other = bars[c][1 + w], bars[c][2 - w]
        if pp and w == 1:
            other.arrive()
        yield from wait(bQ[c], 0)
        if total > 0:
            yield from wait(fk[c][0], 0)
            assert slotk[c][0] == 0
            if pp:
                yield from my.sync()
            readers_k[c][0].add(w)
            if pp:
                other.arrive()
            yield
            readers_k[c][0].discard(w)
            ek[c][0].arrive()
            yield from send("x", c, w, 0)
            yield from receive("x", c, w, 0)
            yield  # softmax of the own row
            yield from send("p", c, w, 0)
            for j in range(1, total):
                st, pst = j % S, (j - 1) % S
                yield from wait(fk[c][st], (j // S) & 1)
                yield from wait(fv[c][pst], ((j - 1) // S) & 1)
                assert slotk[c][st] == j and slotv[c][pst] == j - 1, (slotk[c], slotv[c], j)
                if pp:
                    yield from my.sync()
                readers_k[c][st].add(w)  # S_j issued
                yield from receive("p", c, w, j - 1)
                readers_v[c][pst].add(w)  # P_{j-1} V_{j-1} issued
                if pp:
                    other.arrive()
                yield  # S_j done (wait_group 1)
                readers_k[c][st].discard(w)
                ek[c][st].arrive()
                yield from send("x", c, w, j)
                yield from receive("x", c, w, j)
                yield  # softmax
                yield from send("p", c, w, j, bug != "no_p_free_wait")
                yield  # wait_group 0 (P V of block j - 1 done)
                readers_v[c][pst].discard(w)
                ev[c][pst].arrive()
            lst = (total - 1) % S
            yield from wait(fv[c][lst], ((total - 1) // S) & 1)
            assert slotv[c][lst] == total - 1
            if pp:
                yield from my.sync()
            yield from receive("p", c, w, total - 1)
            readers_v[c][lst].add(w)
            if pp:
                other.arrive()
            yield
            readers_v[c][lst].discard(w)
        if pp and w == 0:
            yield from my.sync()
        # the rows' max and sum: phase `total` of the P words, not freed (the last phase)
        yield from send("p", c, w, total, bug != "no_stats_free_wait")
        yield from receive("p", c, w, total, release=False)
        if bug != "no_final_cluster_barrier":
            yield from cluster.sync()
        finish(c)

    def land(x):
        kind, c, a, st, v = x
        assert not exited[c], "a write landing in an exited CTA"
        if kind in ("xx", "xp"):  # the peer's words of block v into region r of X[a] of CTA c
            r = kind[1]
            assert state[r][c][a] is None and not nread[r][c][a], (
                "exchange buffer overwritten while in use",
                r,
                state[r][c][a],
                v,
            )
            state[r][c][a] = v
            full[r][c][a].complete_tx(1)
            return
        if kind == "k":
            slotk[c][st] = v
        if kind == "v":
            slotv[c][st] = v
        a.complete_tx(1)

    ths = [producer(c) for c in range(C)] + [consumer(c, w) for c in range(C) for w in (0, 1)]
    schedule(ths, inflight, land, rng, f"fwd512 cluster ({bug})")
    if bug != "no_final_cluster_barrier":
        assert all(exited)
    for c in range(C):
        assert all(b.cnt == 0 for b in bars[c].values()), "named barrier left half-arrived"
    assert cluster.cnt == 0, "cluster barrier left half-arrived"


def fwd512c_bugs_caught(rng):
    """Each injected error of the D = 512 cluster forward's half exchange must be caught. Three
    waits are implied by the order of the exchanges (the model finds no schedule that needs
    them; the kernel keeps them): xfree before a block's partial (the peer read it before
    sending the P words this CTA waited for), xfree_p before a block's P words (the peer read them
    before sending the partial this CTA waited for), and the final cluster barrier (every remote
    write or arrival into a CTA precedes a wait of that CTA). The xfree_p wait before the final
    max / sum is needed (no_stats_free_wait)."""
    bugs = (
        "xfree_count_one",
        "xfree_parity",
        "wait_before_send",
        "no_arm",
        "no_p_arm",
        "no_stats_free_wait",
    )
    return bugs_caught(
        bugs,
        lambda bug, _: run_fwd512c(
            rng.randrange(1, 7), rng.choice([2, 3]), rng, rng.random() < 0.7, bug
        ),
    )


def run_d256(nblocks, S, rng, bug=None):
    """The D = 256 warp-specialised dK/dV kernel (sm90_bwd256_ws.cuh): run_dkdv's producer (TMA +
    cp.async arrivals on one full barrier per stage), two consumer warpgroups that own the same
    keys and swap their halves of P^T (buffer xpa, named barrier 1) and dS^T (named barrier 2) in
    every block: each writes its half, meets the other at the barrier, reads both halves, issues
    dV (after the P^T swap) or dK (after the dS^T swap); after the final wait it releases the
    stage. One buffer each: a warpgroup writes a swap buffer again only after the other barrier.
    S^T / dP^T read the whole stage (Q, dO) until the wait before dS; dV / dK only the warpgroup's
    own column halves, until the final wait. Injected bugs: no_bar2 (dS^T read without its
    barrier), one_swap_barrier (P^T and dS^T both written before barrier 1, no barrier 2),
    early_release (the stage released after dV's issue). (Its fused-dQ variant was deleted in the
    seventh session.)"""
    L = 3
    bKV = MBar(1)
    full = [MBar(1 + L) for _ in range(S)]
    empty = [MBar(2) for _ in range(S)]
    meta = [None] * S
    slot = [None] * S
    whole = [set() for _ in range(S)]  # warpgroups whose S^T / dP^T read the whole stage
    halves = [[set(), set()] for _ in range(S)]  # [stage][half]: who reads that column half
    inflight = []
    xbuf = {"pa": [None, None], "da": [None, None]}
    xreaders = {"pa": set(), "da": set()}
    bar = [Named(2), Named(2)]

    def busy(s):
        return whole[s] or halves[s][0] or halves[s][1]

    def lane(ln):
        return dkdv_producer_lane(ln, S, nblocks, bKV, full, empty, meta, inflight, busy)

    def write(x, cw, it):
        assert not (xreaders[x] - {cw}), f"{x} half overwritten while the other warpgroup reads it"
        xbuf[x][cw] = it

    def read(x, it):
        assert xbuf[x] == [it, it], (x, xbuf[x], it)

    def consumer(cw):
        yield from wait(bKV, 0)
        it = 0
        while True:
            s = it % S
            yield from wait(full[s], (it // S) & 1)
            if meta[s] == "end":
                break
            assert meta[s] == it and slot[s] == it, (meta[s], slot[s], it)
            whole[s].add(cw)
            halves[s][cw].add(cw)
            yield  # S^T, dP^T issued; P after the first wait
            write("pa", cw, it)
            if bug == "one_swap_barrier":
                write("da", cw, it)
            yield from bar[0].sync()
            read("pa", it)
            xreaders["pa"].add(cw)
            yield  # the shared loads of both P^T halves
            xreaders["pa"].discard(cw)
            yield  # dV issued; dS after dP^T's wait
            whole[s].discard(cw)
            if bug == "early_release":
                empty[s].arrive()  # while dV (and then dK) still read the stage
            if bug != "one_swap_barrier":
                write("da", cw, it)
                if bug != "no_bar2":
                    yield from bar[1].sync()
            read("da", it)
            xreaders["da"].add(cw)
            yield  # the shared loads of both dS^T halves
            xreaders["da"].discard(cw)
            yield  # dK issued; dV and dK read the stage until the final wait
            halves[s][cw].discard(cw)
            if bug != "early_release":
                empty[s].arrive()
            it += 1

    def land(x):
        if x[0] == "cp":
            x[1].arrive()
            return
        b, s, v = x
        if s is not None:
            slot[s] = v
            assert not busy(s), "stage landed while read"
        b.complete_tx(1)

    ths = [lane(i) for i in range(L)] + [consumer(0), consumer(1)]
    schedule(ths, inflight, land, rng, "dkdv D = 256")
    assert bar[0].cnt == 0 and bar[1].cnt == 0, "named barrier left half-arrived"


def variant_bugs_caught(rng):
    """Each injected error of the fused D = 64/128 kernel's deleted variants
    (DUALKV_SM90_BWD_VARIANT: two dQ buffers, one reduction per block) must be caught by some
    schedule: one_parity (the buffers' barriers waited with the single buffer's parity it & 1),
    reducer_buf0 (the reducer reads buffer 0 only), end_buf0 (the end record always in buffer
    0), no_x_free (warpgroup 1 overwrites the exchange buffer without waiting for warpgroup 0's
    read), no_x_full (warpgroup 0 reads it without waiting), early_x_free (x_free arrived before
    the read), x_alias (the exchange buffer is warpgroup 0's dQ buffer 0, which its reducer
    reads)."""
    bugs = (
        ("one_parity", 2, False),
        ("reducer_buf0", 2, False),
        ("end_buf0", 2, False),
        ("no_x_free", 1, True),
        ("no_x_full", 1, True),
        ("early_x_free", 2, True),
        ("x_alias", 1, True),
    )

    def run_one(b, _):
        bug, nbuf, onered = b
        run_dkdv(
            rng.randrange(1, 7), rng.choice([2, 3]), rng, 5, nbuf, onered, bug, rng.random() < 0.5
        )

    return bugs_caught(bugs, run_one)


def d256_bugs_caught(rng):
    """Each injected error of the D = 256 dK/dV kernel (swaps, release) must be caught by some
    schedule."""
    bugs = ("no_bar2", "one_swap_barrier", "early_release")
    return bugs_caught(bugs, lambda bug, _: run_d256(rng.randrange(1, 7), 2, rng, bug))


def fwd3_bugs_caught(rng):
    """Each injected error of the ping-pong of three consumer warpgroups must be caught."""
    bugs = ("no_finish", "start_by_1", "next_is_prev")
    return bugs_caught(bugs, lambda bug, _: run_fwd(rng.randrange(0, 6), 2, True, rng, 3, bug))


rng = random.Random(1)
n = 0
for _trial in range(3000):
    S = rng.choice([2, 3])
    total = rng.randrange(0, 9)
    run_fwd(total, S, rng.random() < 0.7, rng)
    run_fwd(total, S, rng.random() < 0.7, rng, nc=3)  # the D = 64 forward on 192-row tiles
    run_dq(total, S, rng.random() < 0.7, rng)
    for dq_mode in (0, 1, 2, 3, 5, 4):
        run_dkdv(total, S, rng, dq_mode)
    run_dkdv(total, S, rng, 5, d64=True)  # the default kernel at D = 64
    # D = 64 with 128-query blocks (DUALKV_SM90_D64_TILES=2): D = 128's protocol (named barrier 1
    # joins the dS^T halves, both warpgroups read both) on 2 stages; a warpgroup whose 64 rows
    # are past the block's end hands over an empty block all the same.
    run_dkdv(total, 2, rng, 5)
    for nbuf, onered in ((2, False), (1, True), (2, True)):  # DUALKV_SM90_BWD_VARIANT=1, 2, 3
        run_dkdv(total, 2 if nbuf == 2 else 3, rng, 5, nbuf, onered, d64=rng.random() < 0.5)
    run_dkdv512(total, S, rng)
    run_dkdv512(total, S, rng, dq=True, sv=1)
    run_fwd512c(total, S, rng, rng.random() < 0.8)
    run_d256(total, 2, rng)
    n += 1
print(
    "ok",
    n,
    "random schedules each for fwd (2 and 3 consumer warpgroups), dq, dkdv (dq modes 0-5), "
    "dkdv and dq D = 512 (2-CTA clusters, kPipe order, half exchange; the dQ key split), "
    "fwd D = 512 (2-CTA cluster, split D), dkdv D = 256 (warp-specialised, P^T / dS^T swaps), "
    "dkdv fused-dQ variants 1-3 (two dQ buffers, one reduction per block)",
)
print(
    "ok",
    variant_bugs_caught(rng),
    "injected fused-dQ variant (2 buffers, 1 reduction) errors caught",
)
print("ok", injected_bugs_caught(rng), "injected D = 512 dK/dV protocol errors caught")
print("ok", fwd512c_bugs_caught(rng), "injected D = 512 cluster forward exchange errors caught")
print("ok", pipe_bugs_caught(rng), "injected D = 512 backward kPipe-order errors caught")
print("ok", keysplit_bugs_caught(rng), "injected D = 512 key-split / half-exchange errors caught")
print("ok", d256_bugs_caught(rng), "injected D = 256 dK/dV swap and release errors caught")
print("ok", fwd3_bugs_caught(rng), "injected three-warpgroup forward ping-pong errors caught")
