// attn_mma: FlashAttention-2's forward on tensor cores for f16/bf16
// (ELEM 1 or 2): `mma.sync.m16n8k16` with f32 accumulation. A block of
// MMA_WARPS warps owns BM = 16 * MMA_WARPS query rows of one head; each warp
// owns 16 rows (32 under WIDE, below: BM = 128; under KEY_SPLIT, below:
// BM = 16, shared by the warps).
// With fewer query rows than BM and GQA (`Params::pack` = the group,
// decoding above all), a block's rows instead pack the group's
// query heads, query-major (row L: query L / pack, head kvh * pack + L %
// pack), so the heads that share a K/V head share each K/V tile it loads
// and fewer rows are padding (a 32:8 decode step: 4 real rows per block
// instead of 1 in each of 4 blocks); where a block needs at most 16 rows,
// its warps share them and split the keys instead (KEY_SPLIT below), so a
// decode step computes 16 rows per key, not 64. K/V tiles of BLOCK_N keys
// stream through shared memory; the score tile and the output accumulator
// live in registers, the online softmax runs on them, and the
// probabilities are re-packed from the score accumulators into the A
// operand of P V without touching shared memory.
//
// Fragment layouts of m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"),
// with g = lane / 4 and t = lane % 4:
//   A (16x16, row-major), 4 regs of 2 elements: a0 (row g, cols 2t..2t+1),
//     a1 (row g+8, cols 2t..), a2 (row g, cols 2t+8..), a3 (row g+8, cols 2t+8..)
//   B (16x8, "col": column n contiguous in k), 2 regs: b0 (k 2t..2t+1, col g),
//     b1 (k 2t+8.., col g)
//   C (16x8 f32), 4 regs: c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8, same)
// The element of lower index sits in the lower 16 bits of a register.
//
// Shared memory (16-bit elements): Q [BM][DQK_PAD + 8], then two stages of
// K [BLOCK_N][DQK_PAD + 8] and V [BLOCK_N][DV_PAD + 8], all row-major. Q K^T
// reads its B operand (key n's dims contiguous) with 32-bit loads
// (`ldmatrix.x4` under FAST); P V reads V's columns with `ldmatrix.trans`.
// The +8 padding keeps rows 16-byte aligned and makes a warp's fragment
// loads hit 32 distinct banks.
//
// Pipeline: while the warps compute on one stage, the next K/V tile streams
// into the other with `cp.async` (16-byte copies, zero-filled past the last
// key or head dim) when the layout allows it (`p.kv_vec`: unit stride along
// the head dim, everything else a multiple of 8 elements), element by
// element otherwise.

// FAST (`Kernel::MmaFast`, opt-in until it has passed the suite on a GPU):
// probabilities packed by `cvt.rn`; each warp's Q fragments held in
// registers across key tiles when the Q/K head dim pads to at most 128 (32
// registers; more would spill; under WIDE, whose output takes twice the
// registers, only where both head dims pad to at most 64: two m-tiles of
// Q, 32 registers again); K's fragments loaded two n-tiles at a time
// by `ldmatrix.x4` (one instruction where four 32-bit loads were); no test
// per pair on tiles a row sees whole (without a mask tensor); and, where no
// soft-cap, ALiBi or bias changes the scores (BASE2), scores in base-2
// units with the scale and log2(e) one multiply and exponentials by
// `ex2.approx.ftz` (2 ulp, within the conformance bound's 8; results under
// 2^-126 flush to 0, which the softmax's f32 sums lose anyway). With those
// options the scores keep their natural units and `expf`: the bound counts
// six roundings after the dot product (scale, soft-cap, ALiBi, bias), which
// they already spend, and the conversion to base 2 would be a seventh.

#define MMA_WARPS 4
// KEY_SPLIT (`Variant::key_split`, set by the host when a problem needs at
// most 16 rows per block: decoding): the block's warps share its 16 rows
// instead of taking 16 each, and each warp takes WKEYS = BLOCK_N / 4 keys
// of every K/V tile, with its own softmax state; the warps' states merge
// through shared memory at the end. A decode step then computes 16 rows
// per key instead of 64 (a 32:8 step has 4 real rows), with the same 128
// threads staging each tile.
#if KEY_SPLIT
#define KSPLIT MMA_WARPS
#else
#define KSPLIT 1
#endif
#define WKEYS (BLOCK_N / KSPLIT)
// A warp's keys are whole k-steps of P V (the host asks for KEY_SPLIT only
// with 64-key tiles).
static_assert(WKEYS % 16 == 0, "each warp's keys of a tile are whole k-steps");
// WIDE (`Variant::wide`, set by the host for the fast kernel's prefill
// where the backend allows it): each warp owns MT = 2 m-tiles, 32 rows,
// and a block 128, as FlashAttention-2's forward does; every K and V
// fragment a warp reads from shared memory then feeds two mma.sync instead
// of one, halving the shared-memory reads per tensor-core operation, for
// twice the score and output registers (the host asks for it only with
// both head dims padded to at most 128, and with 32-key tiles where one
// is over 64: `Variant::wide_ok`, `Variant::block_n`).
#if WIDE
#define MT 2
#else
#define MT 1
#endif
static_assert(!(WIDE && KEY_SPLIT), "a block is wide or splits its keys, not both");
#if FAST && DQK_PAD * MT <= 128 && (MT == 1 || DV_PAD <= 64)
#define Q_IN_REGS 1
#else
#define Q_IN_REGS 0
#endif
// BASE2 is set by the host (`Variant::base2`).
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f
#define BM (16 * MT * MMA_WARPS / KSPLIT)
// Rows of the block one thread computes: two per m-tile.
#define RR (2 * MT)
#define QSTR (DQK_PAD + 8)
#define KSTR (DQK_PAD + 8)
#define VSTR (DV_PAD + 8)
#define STAGE (BLOCK_N * KSTR + BLOCK_N * VSTR)

__device__ __forceinline__ u32 ld32(const u16* p) {
#ifdef ATTN_EMU
    emu::check_aligned(p, 4, "a 32-bit shared-memory load");
#endif
    return *(const u32*)p;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, asynchronously; `bytes` < 16 zero-fills the rest.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, u32 bytes) {
#ifdef ATTN_EMU
    emu::cp_async_cg16(smem_addr(dst), src, bytes);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef ATTN_EMU
    emu::cp_async_commit_group();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef ATTN_EMU
    emu::cp_async_wait_group(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Two 8x8 16-bit matrices, transposed: lanes 0-7 address the rows of the
// first, lanes 8-15 of the second. Lane l receives, of each, the elements
// (rows 2(l%4) and 2(l%4)+1, column l/4): the B fragment of m16n8k16 when
// the rows are 16 consecutive keys of V and the column block is 8 head dims.
__device__ __forceinline__ void ldmatrix_x2_trans(const u16* row, u32* b0, u32* b1) {
#ifdef ATTN_EMU
    u32 r[2];
    emu::ldmatrix(2, true, smem_addr(row), r);
    *b0 = r[0];
    *b1 = r[1];
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(*b0), "=r"(*b1)
                 : "r"(smem_addr(row)));
#endif
}

// Four 8x8 16-bit matrices: lanes 8i..8i+7 address the rows of matrix i;
// lane l receives, of each, row l/4, columns 2(l%4) and 2(l%4)+1 (register
// i for matrix i): from K's rows (keys) the B fragments b0, b1 of two
// n-tiles of m16n8k16.
__device__ __forceinline__ void ldmatrix_x4(const u16* row, u32* b) {
#ifdef ATTN_EMU
    emu::ldmatrix(4, false, smem_addr(row), b);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(smem_addr(row)));
#endif
}

// Rows [t0, t0 + BLOCK_N) of one head of K or V (`base`: the head's offset,
// `row_st`/`dim_st`: its strides along keys and dims) into shared memory [BLOCK_N][STR], zero past
// `bhi` and past the head dim D. With `vec` (see `Params::kv_vec`) and D a
// multiple of 8, 16-byte `cp.async` copies; else element by element.
template <int D, int DPAD, int STR>
__device__ __forceinline__ void stage_rows(const u16* g, i64 base, i64 row_st, i64 dim_st, u16* s,
                                           int t0, int bhi, bool vec) {
    if (D % 8 == 0 && vec) {
        for (int e = threadIdx.x; e < BLOCK_N * (DPAD / 8); e += blockDim.x) {
            const int r = e / (DPAD / 8), d = (e % (DPAD / 8)) * 8, j = t0 + r;
            const bool ok = j < bhi && d < D;
            const u16* src = ok ? g + base + (i64)j * row_st + d : g;
            cp_async16(s + r * STR + d, src, ok ? 16u : 0u);
        }
        return;
    }
    for (int e = threadIdx.x; e < BLOCK_N * DPAD; e += blockDim.x) {
        const int r = e / DPAD, d = e % DPAD, j = t0 + r;
        s[r * STR + d] = (j < bhi && d < D) ? g[base + (i64)j * row_st + (i64)d * dim_st] : (u16)0;
    }
}

// Loads keys [t0, t0 + BLOCK_N) of K and V into one stage.
__device__ __forceinline__ void load_kv(const Params& p, u16* Ks, u16* Vs, int b, int kvh,
                                        int t0, int bhi) {
    stage_rows<DQK, DQK_PAD, KSTR>((const u16*)p.k,
                                   p.k_off + (i64)b * p.k_st[0] + (i64)kvh * p.k_st[2], p.k_st[1], p.k_st[3],
                                   Ks, t0, bhi, p.kv_vec != 0);
    stage_rows<DV, DV_PAD, VSTR>((const u16*)p.v,
                                 p.v_off + (i64)b * p.v_st[0] + (i64)kvh * p.v_st[2], p.v_st[1], p.v_st[3], Vs,
                                 t0, bhi, p.kv_vec != 0);
}

__device__ __forceinline__ u16 to_elem_bits(float x) {
#if ELEM == 1
    return f32_to_f16(x);
#else
    return f32_to_bf16(x);
#endif
}

// Two probabilities into one A-operand register, `lo` in the low half.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
#if FAST
    // cvt's first source goes to the upper half, its second to the lower.
    u32 r;
#if defined(ATTN_EMU) && ELEM == 1
    r = emu::cvt_rn_f16x2(hi, lo);
#elif defined(ATTN_EMU)
    r = emu::cvt_rn_bf16x2(hi, lo);
#elif ELEM == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
#else
    return (u32)to_elem_bits(lo) | ((u32)to_elem_bits(hi) << 16);
#endif
}

#if BASE2
// 2^x; 2^-inf = +0, NaN stays NaN.
__device__ __forceinline__ float ex2(float x) {
#ifdef ATTN_EMU
    return emu::ex2_approx_ftz(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#endif
}

// score() in base-2 units where nothing but the scale and the masks
// changes the scores: `scale2` is the scale times log2(e).
__device__ __forceinline__ float score2(const Params& p, int b, int h, int i, int j, int lo,
                                        int hi, float dot, float scale2) {
    if (j < lo || j >= hi || masked_out(p, b, h, i, j)) {
        return NEG_INF;
    }
    return dot * scale2;
}
#define EXP ex2
#else
#define EXP expf
#endif

// The head of packed row L: with `pack` > 1 (the block's rows pack the
// query heads of K/V head `kvh`'s group, `Params::pack`), head kvh * pack
// + L % pack, query L / pack; else the grid's head, query L.
__device__ __forceinline__ int row_head(int L, int pack, int kvh) {
    return pack > 1 ? kvh * pack + L % pack : (int)blockIdx.y;
}

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
#ifdef ATTN_EMU
    emu::mma16816<ELEM == 2>(c, a0, a1, a2, a3, b0, b1);
#elif ELEM == 1
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Under KEY_SPLIT, "at least one block per multiprocessor", which every
// launch meets anyway: without it ptxas held some decode variants to 80
// registers and spilled 8 bytes (cuda-check), whichever other code changed.
#if KEY_SPLIT
#define MMA_BOUNDS __launch_bounds__(MMA_WARPS * 32, 1)
#else
#define MMA_BOUNDS __launch_bounds__(MMA_WARPS * 32)
#endif
extern "C" __global__ void MMA_BOUNDS attn_mma(const Params p) {
    DYNAMIC_SMEM(unsigned char, smem_raw);
    u16* Qs = (u16*)smem_raw;          // [BM][QSTR]
    u16* st0 = Qs + BM * QSTR;         // two stages of K [BLOCK_N][KSTR], V [BLOCK_N][VSTR]

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // The warp's first row in the block (its MT m-tiles follow on), and
    // its first key in each tile.
    const int wrow = (warp / KSPLIT) * 16 * MT, koff = (warp % KSPLIT) * WKEYS;
    const int gq = lane >> 2, tq = lane & 3;
    const int b = blockIdx.z / p.num_splits;
    const int split = blockIdx.z % p.num_splits;
    const int pack = p.pack > 1 ? p.pack : 1;
    const int kvh = pack > 1 ? (int)blockIdx.y : (int)blockIdx.y / (p.hq / p.hkv);
    // The block's rows: packed row L = row0 + r is query L / pack of
    // head row_head(L) (row_head in this file's header).
    const int row0 = blockIdx.x * BM;
    const SeqMask m = seq_mask(p, b);
    int blo, bhi;
    block_keys(p, m, row0 / pack, (row0 + BM - 1) / pack + 1, split, &blo, &bhi);

    const u16* qg = (const u16*)p.q;
    for (int e = threadIdx.x; e < BM * DQK_PAD; e += blockDim.x) {
        const int r = e / DQK_PAD, d = e % DQK_PAD, i = (row0 + r) / pack;
        const int hh = row_head(row0 + r, pack, kvh);
        u16 x = 0;
        if (i < p.sq && d < DQK) {
            x = qg[p.q_off + (i64)b * p.q_st[0] + (i64)i * p.q_st[1] + (i64)hh * p.q_st[2] +
                   (i64)d * p.q_st[3]];
        }
        Qs[r * QSTR + d] = x;
    }

    // This thread's rows: 2 per m-tile, rr = 2t + r for row g (r = 0) or
    // g + 8 (r = 1) of m-tile t; their packed rows (ROW), queries and
    // heads (HEAD, recomputed where needed rather than held in registers
    // across the loop).
    int rows[RR], lo[RR], hi[RR];
#define ROW(rr) (row0 + wrow + 16 * ((rr) >> 1) + gq + 8 * ((rr) & 1))
#define HEAD(rr) row_head(ROW(rr), pack, kvh)
    float mr[RR], lr[RR];
#pragma unroll
    for (int rr = 0; rr < RR; ++rr) {
        rows[rr] = ROW(rr) / pack;
        key_range(p, m, rows[rr], &lo[rr], &hi[rr]);
        mr[rr] = NEG_INF;
        lr[rr] = 0.0f;
#if HAS_SINKS
        // The sink is one virtual key: counted once per row (by t == 0,
        // in the first warp of the row's key split).
        if (p.num_splits == 1 && rows[rr] < m.ql && warp % KSPLIT == 0) {
#if BASE2
            mr[rr] = p.sinks[HEAD(rr)] * LOG2E_F;
#else
            mr[rr] = p.sinks[HEAD(rr)];
#endif
            lr[rr] = (tq == 0 && mr[rr] != NEG_INF) ? 1.0f : 0.0f;
        }
#endif
    }
    float o[MT][DV_PAD / 8][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int n = 0; n < DV_PAD / 8; ++n) {
            o[t][n][0] = o[t][n][1] = o[t][n][2] = o[t][n][3] = 0.0f;
        }
    }
#if BASE2
    const float scale2 = p.scale * LOG2E_F;
#endif
#if FAST
    // This lane's row and column in ldmatrix.x4's four 8x8 matrices of K.
    const int ldm_key = (lane & 7) + ((lane >> 4) << 3);
    const int ldm_col = ((lane >> 3) & 1) * 8;
#endif
#if Q_IN_REGS
    // The warp's A fragments of Q, read once (every thread reaches this
    // barrier: Q's staging above is then visible).
    __syncthreads();
    u32 qf[MT][DQK_PAD / 16][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int kk = 0; kk < DQK_PAD / 16; ++kk) {
            const u16* qw = Qs + (wrow + 16 * t) * QSTR;
            const int c = kk * 16 + 2 * tq;
            qf[t][kk][0] = ld32(qw + gq * QSTR + c);
            qf[t][kk][1] = ld32(qw + (gq + 8) * QSTR + c);
            qf[t][kk][2] = ld32(qw + gq * QSTR + c + 8);
            qf[t][kk][3] = ld32(qw + (gq + 8) * QSTR + c + 8);
        }
    }
#endif

    // Stage the first tile; each iteration then prefetches the next tile
    // into the other stage before computing on its own.
    if (blo < bhi) {
        load_kv(p, st0, st0 + BLOCK_N * KSTR, b, kvh, blo, bhi);
    }
    cp_async_commit();
    int stage = 0;
    for (int t0 = blo; t0 < bhi; t0 += BLOCK_N, stage ^= 1) {
        const u16* Ks = st0 + stage * STAGE;
        const u16* Vs = Ks + BLOCK_N * KSTR;
        if (t0 + BLOCK_N < bhi) {
            u16* nk = st0 + (stage ^ 1) * STAGE;
            load_kv(p, nk, nk + BLOCK_N * KSTR, b, kvh, t0 + BLOCK_N, bhi);
            cp_async_commit();
            cp_async_wait<1>();  // this tile's copies are done, the next may fly
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies (and Q) are visible

        // S = Q K^T for the warp's 16 * MT rows and its WKEYS keys of the
        // tile: each fragment of K read from shared memory serves the
        // warp's MT m-tiles.
        float s[MT][WKEYS / 8][4];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
#pragma unroll
            for (int n = 0; n < WKEYS / 8; ++n) {
                s[t][n][0] = s[t][n][1] = s[t][n][2] = s[t][n][3] = 0.0f;
            }
        }
#pragma unroll
        for (int kk = 0; kk < DQK_PAD / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int t = 0; t < MT; ++t) {
#if Q_IN_REGS
                a[t][0] = qf[t][kk][0];
                a[t][1] = qf[t][kk][1];
                a[t][2] = qf[t][kk][2];
                a[t][3] = qf[t][kk][3];
#else
                const u16* qw = Qs + (wrow + 16 * t) * QSTR;
                const int c = kk * 16 + 2 * tq;
                a[t][0] = ld32(qw + gq * QSTR + c);
                a[t][1] = ld32(qw + (gq + 8) * QSTR + c);
                a[t][2] = ld32(qw + gq * QSTR + c + 8);
                a[t][3] = ld32(qw + (gq + 8) * QSTR + c + 8);
#endif
            }
#if FAST
            // K's B fragments of two n-tiles by one ldmatrix.x4: lanes
            // 0-7 address keys n*8.. at dims kk*16.., lanes 8-15 the same
            // keys at kk*16+8.., lanes 16-31 the same for keys (n+1)*8...
            const u16* kx = Ks + (koff + ldm_key) * KSTR + kk * 16 + ldm_col;
#pragma unroll
            for (int n = 0; n < WKEYS / 8; n += 2) {
                u32 kb[4];
                ldmatrix_x4(kx + n * 8 * KSTR, kb);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma16816(s[t][n], a[t][0], a[t][1], a[t][2], a[t][3], kb[0], kb[1]);
                    mma16816(s[t][n + 1], a[t][0], a[t][1], a[t][2], a[t][3], kb[2], kb[3]);
                }
            }
#else
            const int c = kk * 16 + 2 * tq;
#pragma unroll
            for (int n = 0; n < WKEYS / 8; ++n) {
                const u16* kr = Ks + (koff + n * 8 + gq) * KSTR + c;
                const u32 b0 = ld32(kr), b1 = ld32(kr + 8);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma16816(s[t][n], a[t][0], a[t][1], a[t][2], a[t][3], b0, b1);
                }
            }
#endif
        }

        // Scores (scale, softcap, ALiBi, bias, masks), then the online
        // softmax of each of the thread's rows.
#pragma unroll
        for (int rr = 0; rr < RR; ++rr) {
            const int t = rr >> 1, r = rr & 1;
            float tmax = NEG_INF;
#if BASE2 && !HAS_MASK
            // A tile whose every key this row sees: no test per pair.
            const bool full = t0 >= lo[rr] && t0 + BLOCK_N <= hi[rr] && t0 + BLOCK_N <= bhi;
#endif
#pragma unroll
            for (int n = 0; n < WKEYS / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = t0 + koff + n * 8 + 2 * tq + e;
                    const float dot = s[t][n][2 * r + e];
#if BASE2 && !HAS_MASK
                    float x = full ? dot * scale2
                          : j < bhi ? score2(p, b, HEAD(rr), rows[rr], j, lo[rr], hi[rr], dot,
                                             scale2)
                                    : NEG_INF;
#elif BASE2
                    float x = j < bhi ? score2(p, b, HEAD(rr), rows[rr], j, lo[rr], hi[rr], dot,
                                               scale2)
                                      : NEG_INF;
#else
                    float x = j < bhi ? score(p, m, b, HEAD(rr), rows[rr], j, lo[rr], hi[rr], dot)
                                      : NEG_INF;
#endif
                    s[t][n][2 * r + e] = x;
                    tmax = fmaxf(tmax, x);
                }
            }
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
            const float mnew = fmaxf(mr[rr], tmax);
            const float mu = mnew == NEG_INF ? 0.0f : mnew;
            const float alpha = EXP(mr[rr] - mu);
            mr[rr] = mnew;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < WKEYS / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float pe = EXP(s[t][n][2 * r + e] - mu);
                    s[t][n][2 * r + e] = pe;
                    sum += pe;
                }
            }
            lr[rr] = lr[rr] * alpha + sum;
#pragma unroll
            for (int n = 0; n < DV_PAD / 8; ++n) {
                o[t][n][2 * r] *= alpha;
                o[t][n][2 * r + 1] *= alpha;
            }
        }

        // O += P V: the score accumulators of key tiles 2kk and 2kk+1 are
        // exactly the A fragment of k-step kk; each fragment of V read
        // from shared memory serves the warp's MT m-tiles.
#pragma unroll
        for (int kk = 0; kk < WKEYS / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                a[t][0] = pack2(s[t][2 * kk][0], s[t][2 * kk][1]);
                a[t][1] = pack2(s[t][2 * kk][2], s[t][2 * kk][3]);
                a[t][2] = pack2(s[t][2 * kk + 1][0], s[t][2 * kk + 1][1]);
                a[t][3] = pack2(s[t][2 * kk + 1][2], s[t][2 * kk + 1][3]);
            }
            // Lanes 0-15 address keys kk*16 + (lane % 16); the column block
            // moves with n.
            const u16* vrow = Vs + (koff + kk * 16 + (lane & 15)) * VSTR;
#pragma unroll
            for (int n = 0; n < DV_PAD / 8; ++n) {
                u32 b0, b1;
                ldmatrix_x2_trans(vrow + n * 8, &b0, &b1);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma16816(o[t][n], a[t][0], a[t][1], a[t][2], a[t][3], b0, b1);
                }
            }
        }
        __syncthreads();  // this stage is consumed before it is refilled
    }

    // The row sums are split over the 4 threads of a row group.
#pragma unroll
    for (int rr = 0; rr < RR; ++rr) {
        lr[rr] += __shfl_xor_sync(0xffffffffu, lr[rr], 1);
        lr[rr] += __shfl_xor_sync(0xffffffffu, lr[rr], 2);
    }
#if KSPLIT > 1
    // The key split's merge (one m-tile per warp: MT is 1 here): warps 1..
    // leave their states in the stages' memory (free since the loop's last
    // barrier), each value at [slot][lane] so the first warp's lanes read
    // their own rows' values; the first warp folds them into its own as the
    // online softmax folds a tile, then writes the rows.
    {
        constexpr int SLOTS = DV_PAD / 8 * 4 + 4;
        static_assert((KSPLIT - 1) * SLOTS * 32 * 4 <= 2 * STAGE * 2,
                      "the merge fits in the stages");
        float* red = (float*)st0;
        const int kw = warp % KSPLIT;
        if (kw > 0) {
            float* mine = red + (kw - 1) * SLOTS * 32 + lane;
#pragma unroll
            for (int n = 0; n < DV_PAD / 8; ++n) {
#pragma unroll
                for (int c = 0; c < 4; ++c) mine[(n * 4 + c) * 32] = o[0][n][c];
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mine[(SLOTS - 4 + r) * 32] = mr[r];
                mine[(SLOTS - 2 + r) * 32] = lr[r];
            }
        }
        __syncthreads();
        if (kw > 0) return;
        for (int w = 1; w < KSPLIT; ++w) {
            const float* th = red + (w - 1) * SLOTS * 32 + lane;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float m2 = th[(SLOTS - 4 + r) * 32], l2 = th[(SLOTS - 2 + r) * 32];
                const float mnew = fmaxf(mr[r], m2);
                const float mu = mnew == NEG_INF ? 0.0f : mnew;
                const float a1 = EXP(mr[r] - mu), a2 = EXP(m2 - mu);
                lr[r] = lr[r] * a1 + l2 * a2;
#pragma unroll
                for (int n = 0; n < DV_PAD / 8; ++n) {
                    o[0][n][2 * r] = o[0][n][2 * r] * a1 + th[(n * 4 + 2 * r) * 32] * a2;
                    o[0][n][2 * r + 1] =
                        o[0][n][2 * r + 1] * a1 + th[(n * 4 + 2 * r + 1) * 32] * a2;
                }
                mr[r] = mnew;
            }
        }
    }
#endif
#pragma unroll
    for (int rr = 0; rr < RR; ++rr) {
        const int t = rr >> 1, r = rr & 1;
        const int i = rows[rr], h = HEAD(rr);
        if (i >= p.sq) continue;
        float L, inv;
#if BASE2
        // The max back in natural units; a sink that stayed the maximum
        // gives its own value, not a round trip through base 2 (its
        // magnitude is not in the bound's score term).
        float mn = mr[rr] * LN2_F;
#if HAS_SINKS
        if (p.num_splits == 1 && i < m.ql && mr[rr] == p.sinks[h] * LOG2E_F) mn = p.sinks[h];
#endif
        row_lse(mn, lr[rr], &L, &inv);
#else
        row_lse(mr[rr], lr[rr], &L, &inv);
#endif
        const i64 prow = (((i64)split * p.batch + b) * p.hq + h) * p.sq + i;
#pragma unroll
        for (int n = 0; n < DV_PAD / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = n * 8 + 2 * tq + e;
                if (d >= DV) continue;
                const float x = o[t][n][2 * r + e] * inv;
                if (p.num_splits == 1) {
                    store_elem(p.o, p.o_off + (i64)b * p.o_st[0] + (i64)i * p.o_st[1] +
                                        (i64)h * p.o_st[2] + (i64)d * p.o_st[3],
                               x);
                } else {
                    p.part_o[prow * DV + d] = x;
                }
            }
        }
        if (tq == 0) {
            if (p.num_splits == 1) {
                if (p.lse) p.lse[((i64)b * p.hq + h) * p.sq + i] = L;
            } else {
                p.part_lse[prow] = L;
            }
        }
    }
#undef HEAD
#undef ROW
}
