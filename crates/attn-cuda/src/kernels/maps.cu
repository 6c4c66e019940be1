// Attention maps (attn-spec's `maps` module): the probabilities of the
// selected rows, exp(s - lse) from the forward's log-sum-exp, in f32; 0
// where a pair is hidden or the row sees nothing. One warp per map row
// (MAPS_WARPS rows of one plane per block), the row's query in shared
// memory, a key per lane; averaged maps sum the selected heads in
// selection order, then divide by their count once. Every element has one
// writer and a fixed order: deterministic. Not tuned for speed: a map is
// for looking at, and costs one Q K^T over what was asked.

#define MAPS_WARPS 8

struct MapsParams {
    Params p;             // the forward's problem; p.lse is the log-sum-exp read
    float* maps;          // [n_batches][n_heads or 1][n_rows][sk]
    const int* batches;   // [n_batches] batch entries
    const int* heads;     // [n_heads] query heads
    int n_batches, n_heads, row0, n_rows;
    int averaged, pad;
};

extern "C" __global__ void __launch_bounds__(MAPS_WARPS * 32)
attn_maps(const MapsParams mp) {
    const Params& p = mp.p;
    STATIC_SMEM(float, qs, [MAPS_WARPS][DQK_PAD]);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * MAPS_WARPS + warp;
    const int plane = blockIdx.y, bi = blockIdx.z;
    if (r >= mp.n_rows) return;  // a whole warp: no block-wide sync follows
    const int b = mp.batches[bi];
    const int i = mp.row0 + r;
    const SeqMask m = seq_mask(p, b);
    int lo, hi;
    key_range(p, m, i, &lo, &hi);
    const int planes = mp.averaged ? 1 : mp.n_heads;
    float* out = mp.maps + (((i64)bi * planes + plane) * mp.n_rows + r) * (i64)p.sk;
    for (int j = lane; j < p.sk; j += 32) out[j] = 0.0f;
    __syncwarp();
    const int h0 = mp.averaged ? 0 : plane;
    const int h1 = mp.averaged ? mp.n_heads : plane + 1;
    const int group = p.hq / p.hkv;
    for (int hs = h0; hs < h1; ++hs) {
        const int h = mp.heads[hs];
        const int kvh = h / group;
        const float lse = p.lse[((i64)b * p.hq + h) * p.sq + i];
        load_row_warp(qs[warp], DQK_PAD, DQK, p.q,
                      p.q_off + (i64)b * p.q_st[0] + (i64)i * p.q_st[1] + (i64)h * p.q_st[2],
                      p.q_st[3], true);
        __syncwarp();
        if (lse != NEG_INF) {
            const i64 kb = p.k_off + (i64)b * p.k_st[0] + (i64)kvh * p.k_st[2];
            for (int j = lo + lane; j < hi; j += 32) {
                float dot = 0.0f;
                for (int d = 0; d < DQK; ++d) {
                    dot = fmaf(qs[warp][d], load_elem(p.k, kb + (i64)j * p.k_st[1] + (i64)d * p.k_st[3]), dot);
                }
                const float s = score(p, m, b, h, i, j, lo, hi, dot);
                out[j] += (s == NEG_INF) ? 0.0f : expf(s - lse);
            }
        }
        __syncwarp();
    }
    if (mp.averaged && mp.n_heads > 1) {
        for (int j = lane; j < p.sk; j += 32) out[j] = out[j] / (float)mp.n_heads;
    }
}
