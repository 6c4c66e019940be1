// attn_combine: merges the split-KV partial states of each row (flash-
// decoding's second pass). Split s left, per row, its output normalised by
// its own sum (o_s) and its log-sum-exp (lse_s, -inf when it saw no key).
// The row's result is the softmax-weighted mix, the sink taking part in the
// denominator only:
//   M = max(sink, max_s lse_s),  Z = exp(sink - M) + sum_s exp(lse_s - M),
//   o = sum_s exp(lse_s - M) o_s / Z,  lse = M + ln Z.
// One warp per row; lanes own output columns.

#define COMBINE_WARPS 4

extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32)
attn_combine(const Params p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y, b = blockIdx.z;
    const int i = blockIdx.x * COMBINE_WARPS + warp;
    if (i >= p.sq) return;
    const SeqMask m = seq_mask(p, b);
    const i64 split_rows = (i64)p.batch * p.hq * p.sq;
    const i64 row = ((i64)b * p.hq + h) * p.sq + i;

    float M = NEG_INF;
    float sink = NEG_INF;
#if HAS_SINKS
    if (i < m.ql) sink = p.sinks[h];
#endif
    M = sink;
    if (i < m.ql) {
        // NaN-propagating: a NaN partial (or sink) makes the row NaN.
        for (int s = 0; s < p.num_splits; ++s) M = nan_max(M, p.part_lse[s * split_rows + row]);
    }
    const bool empty = M == NEG_INF;
    float Z = empty ? 0.0f : expf(sink - M);
    if (!empty) {
        for (int s = 0; s < p.num_splits; ++s) Z += expf(p.part_lse[s * split_rows + row] - M);
    }
    const float inv = empty ? 0.0f : 1.0f / Z;
    for (int d = lane; d < DV; d += 32) {
        float acc = 0.0f;
        if (!empty) {
            for (int s = 0; s < p.num_splits; ++s) {
                float w = expf(p.part_lse[s * split_rows + row] - M);
                acc = fmaf(w, p.part_o[(s * split_rows + row) * DV + d], acc);
            }
        }
        store_elem(p.o, p.o_off + (i64)b * p.o_st[0] + (i64)i * p.o_st[1] +
                            (i64)h * p.o_st[2] + (i64)d * p.o_st[3],
                   acc * inv);
    }
    if (p.lse && lane == 0) p.lse[row] = empty ? NEG_INF : M + logf(Z);
}
