//! bf16 inputs on AVX512_BF16: the backward's five products on
//! `vdpbf16ps` (`dot16::gemm_pairs`), which multiplies pairs of bf16 and
//! adds both products to an f32 lane, flushing subnormal inputs and
//! results to zero (DAZ, FTZ).
//!
//! | product       | A (broadcast)                   | B (streamed)                 |
//! |---------------|---------------------------------|------------------------------|
//! | `S = Q K^T`   | Q, pairs of head dims (task)    | K^T, pairs of rows (block)   |
//! | `dP = dO V^T` | dO, pairs of head dims (task)   | V^T, pairs of rows (block)   |
//! | `dV = P^T dO` | `P * 2^56`, pairs of rows (tile) | dO, pairs of rows (task)    |
//! | `dK = dS^T Q` | `dS * 2^t`, pairs of rows (tile) | Q, pairs of rows (task)     |
//! | `dQ = dS K`   | `dS * 2^t`, pairs of keys (tile) | K, pairs of keys (block)    |
//!
//! (`dS` here is `dsc = dS g`, the gradient of `q . k`.) The last three
//! add into dV, dK and dQ times the inverse power of two, in one fused
//! multiply-add per element as their tiles leave the registers
//! (`PairOut::Add`): the scaled product is exact, so this rounds as the
//! f32 sum would; where it is subnormal it rounds once, not twice.
//!
//! **Why nothing flushes.** A nonzero normal bf16 is `a = m 2^(e - 7)`
//! with an integer `m` in `[128, 256)`, so the product of `a` and `b` is a
//! multiple of `2^(e_a + e_b - 14)`. If every product of a call has `e_a +
//! e_b >= -112` (or a zero factor), every product and every running sum
//! from 0 is a multiple of `2^-126`: the rounding of such a sum is the sum
//! itself when it is below `2^-103` in size (it then has at most 23
//! significant bits), else a multiple of its ulp, which is at least
//! `2^-126`. So a nonzero sum is never subnormal, and `vdpbf16ps` rounds
//! exactly as f32 arithmetic would. The operands are kept there:
//! - Q, K, V and dO: 0 or in `[2^-40, 2^40)` (`dot16::BACKWARD`), checked
//!   for the task's rows while packing them and for each key block; else
//!   the task or block runs its products in f32. `S`, `dP`: `e_a + e_b >=
//!   -80`.
//! - `P`: below `2^-126` it is set to 0 (with its `dS`), within the
//!   bound's `2^-125` allowance for an underflowing probability
//!   (`attn-conformance/src/backward/bound.rs`); times `2^56` it is then 0
//!   or in `[2^-70, 2^56]`: with dO, `e_a + e_b >= -110`.
//! - `dS`: a power of two `2^t` per tile takes its largest magnitude into
//!   `[2^55, 2^56)`; the tile runs dK and dQ on pairs only if every
//!   nonzero `dS 2^t` is then at least `2^-72` (with Q or K, `>= -112`),
//!   else in f32. A tile whose `dS` is all 0 adds nothing.
//!
//! Nor does anything overflow: a product is below `2^57 2^40`, a tile
//! sums at most `BWD_ROWS` or `BWD_KEYS` of them, `S` and `dP` `d <
//! 2^14`. Rounding `P` and `dS` to bf16 is what the contract allows a
//! 16-bit kernel (SEMANTICS §7b) and the bound's `u_in` terms cover.

use super::task::{round_up, Scratch};
use super::{Ctx, Outs, Task};
use crate::blocking::{BWD_KEYS, BWD_ROWS, LANES};
use crate::dot16::{pack_words, PairOut, BACKWARD};
use crate::element::CpuElement;

/// `P` is scaled by `2^P_EXP` before it is rounded to bf16.
pub const P_EXP: i32 = 56;

/// `2^e` as an f32 (`e` in `-126..=127`).
pub fn pow2(e: i32) -> f32 {
    assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The exponent `t` for a tile's `dS` of largest magnitude `max` and
/// smallest nonzero magnitude `min` (both finite), when its pair
/// products may run: `max 2^t` below `2^56` and `min 2^t` at least
/// `2^-72`, `2^t` and `2^-t` normal. `None` when they may not, and for an
/// all-zero tile (`max == 0`), which adds nothing.
pub fn ds_exp(max: f32, min: f32) -> Option<i32> {
    if max == 0.0 || !max.is_finite() || min < f32::MIN_POSITIVE || min > max {
        return None;
    }
    let exp = |x: f32| ((x.to_bits() >> 23) & 0xff) as i32 - 127;
    let t = (55 - exp(max)).min(126);
    (exp(min) + t >= -72).then_some(t)
}

/// Packs the task's Q and dO panels (`ws.qp`, `ws.dop`: `group * ql`
/// rows, then `BWD_ROWS` spare ones) as pairs along the head dimension
/// (`q2`, `do2`: for `S` and `dP`) and as pairs of rows (`q2r`, `do2r`:
/// for `dK` and `dV`; head `hh`'s pairs at `hh * ceil(ql / 2)`, a last odd
/// row paired with 0), and sizes the tile buffers. Returns whether every
/// element of the task's rows is 0 or in [`BACKWARD`]; if not, the task
/// runs its products in f32.
#[inline(always)]
pub fn pack_task(ws: &mut Scratch, (group, ql): (usize, usize), (dqk, dv): (usize, usize)) -> bool {
    let (dqkp, dvp) = (round_up(dqk, LANES), round_up(dv, LANES));
    let (rows, real) = (group * ql + BWD_ROWS, group * ql);
    let mut fit = true;
    for (src, dst, w, d) in [
        (&ws.qp, &mut ws.q2, dqkp, dqk),
        (&ws.dop, &mut ws.do2, dvp, dv),
    ] {
        dst.resize(rows * w / 2, 0);
        for (r, (dst, src)) in dst
            .chunks_mut(w / 2)
            .zip(src.chunks(w))
            .take(rows)
            .enumerate()
        {
            // Elements 0..d of the row; an odd d's last pair ends in 0.
            let ok = pack_words(&src[..d], None, &mut dst[..d.div_ceil(2)], BACKWARD);
            fit &= ok || r >= real;
        }
    }
    if !fit {
        return false;
    }
    // The same values as pairs of rows, whole padded rows (0 past d).
    let hp = ql.div_ceil(2);
    for (src, dst, w) in [(&ws.qp, &mut ws.q2r, dqkp), (&ws.dop, &mut ws.do2r, dvp)] {
        dst.resize(group * hp * w, 0);
        for hh in 0..group {
            for rp in 0..hp {
                let at = hh * ql + 2 * rp;
                let odd = match 2 * rp + 1 < ql {
                    true => &src[(at + 1) * w..][..w],
                    false => &ws.zeros[..w],
                };
                let out = &mut dst[(hh * hp + rp) * w..][..w];
                pack_words(&src[at * w..][..w], Some(odd), out, BACKWARD);
            }
        }
    }
    for (buf, len) in [
        (&mut ws.p2, BWD_ROWS / 2 * BWD_KEYS),
        (&mut ws.ds2r, BWD_ROWS / 2 * BWD_KEYS),
        (&mut ws.ds2c, BWD_ROWS * BWD_KEYS / 2),
        (&mut ws.k2r, BWD_KEYS / 2 * dqkp),
    ] {
        buf.resize(len, 0);
    }
    true
}

/// Whether the key blocks of `p` can be packed as pairs straight from
/// its bf16 K and V rows ([`block_from_inputs`]): rows contiguous, head
/// dims even.
pub fn from_inputs(p: &attn_spec::Problem) -> bool {
    let s = p.shape;
    p.k.strides[3] == 1
        && p.v.strides[3] == 1
        && s.head_dim_qk.is_multiple_of(2)
        && s.head_dim_v.is_multiple_of(2)
}

/// [`pack_block`]'s pairs (`kt2`, `vt2`, `k2r`) of key block `j0..j0 + n`
/// of `(b, kvh)`, bit for bit, straight from the bf16 inputs
/// (`dot16::key_block_pairs`): no f32 K^T and V^T on the way. Returns
/// whether every element is 0 or in [`BACKWARD`]; if not, the caller
/// packs the block in f32 and runs its products there.
pub fn block_from_inputs<T: CpuElement>(
    ctx: &Ctx<'_, T>,
    ws: &mut Scratch,
    (b, kvh): (usize, usize),
    (j0, n): (usize, usize),
) -> bool {
    let p = ctx.p;
    let (dqk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    let (dqkp, dvp) = (round_up(dqk, LANES), round_up(dv, LANES));
    assert!(
        T::DTYPE == attn_spec::DType::Bf16
            && size_of::<T>() == 2
            && from_inputs(p)
            && n <= BWD_KEYS
            && ws.k2r.len() >= n.div_ceil(2) * dqkp
    );
    let bits = |x| crate::dot16::bf16_bits(x).expect("bf16 (asserted)");
    ws.kt2.resize(dqkp / 2 * BWD_KEYS, 0);
    ws.vt2.resize(dvp / 2 * BWD_KEYS, 0);
    // SAFETY: rows contiguous and dims even (asserted); kt2 and vt2 hold
    // dqk / 2 and dv / 2 rows of BWD_KEYS >= round_up(n, 16) words, k2r
    // ceil(n / 2) rows of dqkp >= dqk words (sized above, asserted);
    // dot16 checks the CPU.
    unsafe {
        crate::dot16::key_block_pairs(
            (bits(ctx.k), &p.k),
            (bits(ctx.v), &p.v),
            (b, kvh),
            (j0, n),
            (dqk, dv),
            (ws.kt2.as_mut_ptr(), ws.vt2.as_mut_ptr(), BWD_KEYS),
            (ws.k2r.as_mut_ptr(), dqkp),
            BACKWARD,
        )
    }
}

/// Packs a key block of `n` keys (`ws.kt`, `ws.vt`: K^T and V^T, and
/// `ws.kr`: K rows, in f32, 0 past `n` up to a multiple of 16) as pairs:
/// K^T and V^T as pairs of their rows (`kt2`, `vt2`: for `S` and `dP`), K
/// as pairs of keys (`k2r`: for `dQ`, an odd last key paired with 0).
/// Returns whether every element is 0 or in [`BACKWARD`]; if not, the
/// block runs its products in f32.
#[inline(always)]
pub fn pack_block(ws: &mut Scratch, n: usize, (dqk, dv): (usize, usize)) -> bool {
    let (dqkp, dvp) = (round_up(dqk, LANES), round_up(dv, LANES));
    let ncols = round_up(n, LANES);
    let mut fit = true;
    for (src, dst, w, d) in [
        (&ws.kt, &mut ws.kt2, dqkp, dqk),
        (&ws.vt, &mut ws.vt2, dvp, dv),
    ] {
        dst.resize(w / 2 * BWD_KEYS, 0);
        for d2 in 0..d.div_ceil(2) {
            let e = &src[2 * d2 * BWD_KEYS..][..ncols];
            let o = match 2 * d2 + 1 < d {
                true => &src[(2 * d2 + 1) * BWD_KEYS..][..ncols],
                false => &ws.zeros[..ncols],
            };
            let out = &mut dst[d2 * BWD_KEYS..][..ncols];
            fit &= pack_words(e, Some(o), out, BACKWARD);
        }
    }
    if !fit {
        return false;
    }
    for kp in 0..n.div_ceil(2) {
        let odd = match 2 * kp + 1 < n {
            true => &ws.kr[(2 * kp + 1) * dqkp..][..dqkp],
            false => &ws.zeros[..dqkp],
        };
        let out = &mut ws.k2r[kp * dqkp..][..dqkp];
        pack_words(&ws.kr[2 * kp * dqkp..][..dqkp], Some(odd), out, BACKWARD);
    }
    true
}

/// Where one tile of a task sits (`task::run`): `at` = (its first pair of
/// rows in the task's pair-of-rows panels, its first row `i0`), `rows` =
/// (rows, rows rounded up to 12), `keys` = (keys, rounded up to 16, to
/// 12), `dims` = the padded head dims (dqk, dv).
#[derive(Clone, Copy, Debug)]
pub struct Tile {
    /// First pair of rows in the panels, first row.
    pub at: (usize, usize),
    /// Rows, and rows rounded up to 12.
    pub rows: (usize, usize),
    /// Keys, rounded up to 16, rounded up to 12.
    pub keys: (usize, usize, usize),
    /// Padded head dims of Q/K and of V.
    pub dims: (usize, usize),
}

/// The tile's last three products on pairs: dV always, dK and dQ when its
/// dS (`stats` = largest and smallest nonzero |dS| and whether every D
/// was finite) fits a scale ([`ds_exp`]). `ws.s` holds P (0 below
/// 2^-126) and `ws.dp` dS, `mqp` rows of `BWD_KEYS`. Returns whether dK
/// and dQ are done (or need nothing: an all-zero dS); else the caller runs
/// them in f32.
#[inline(always)]
pub fn products<T: CpuElement>(
    ws: &mut Scratch,
    (outs, task, hh): (&Outs<T>, &Task, usize),
    g: Tile,
    (max, min, finite): (f32, f32, bool),
) -> bool {
    let i0 = g.at.1;
    let (mq, mqp) = g.rows;
    let (n, ncols, nk) = g.keys;
    let (dqkp, dvp) = g.dims;
    let t = if finite { ds_exp(max, min) } else { None };
    let mut ds_done = finite && max == 0.0;
    let at2 = (g.at.0, mq.div_ceil(2));
    assert!(
        i0.is_multiple_of(2)
            && nk.is_multiple_of(12)
            && (at2.0 + at2.1) * dvp <= ws.do2r.len()
            && (at2.0 + at2.1) * dqkp <= ws.q2r.len()
            && at2.1 * BWD_KEYS <= ws.p2.len()
            && mqp * BWD_KEYS / 2 <= ws.ds2c.len()
            && n.div_ceil(2) * dqkp <= ws.k2r.len()
            && nk * dqkp <= ws.dk.len()
            && nk * dvp <= ws.dv.len()
    );
    // SAFETY: s and dp hold mqp rows of BWD_KEYS >= ncols floats, their P
    // and dsc normal or 0 (P below 2^-126 was set to 0 and the rest is at
    // most 1, times 2^56; dsc times 2^t per ds_exp); the word and float
    // buffers hold the extents asserted (a pair row of p2, ds2r BWD_KEYS
    // >= nk words, of ds2c BWD_KEYS / 2); nk and mqp are multiples of 12,
    // dvp and dqkp of 16; round_tile and gemm_pairs check the CPU.
    unsafe {
        crate::dot16::round_tile(
            (ws.s.as_ptr(), BWD_KEYS),
            (mq, ncols),
            pow2(P_EXP),
            (ws.p2.as_mut_ptr(), BWD_KEYS),
            false,
        );
        crate::dot16::gemm_pairs(
            (nk, dvp, at2.1),
            (ws.p2.as_ptr(), 1, BWD_KEYS),
            (ws.do2r[at2.0 * dvp..].as_ptr(), dvp),
            (ws.dv.as_mut_ptr(), dvp, PairOut::Add(pow2(-P_EXP))),
        );
        if let Some(t) = t {
            crate::dot16::round_tile(
                (ws.dp.as_ptr(), BWD_KEYS),
                (mq, ncols),
                pow2(t),
                (ws.ds2r.as_mut_ptr(), BWD_KEYS),
                false,
            );
            crate::dot16::round_tile(
                (ws.dp.as_ptr(), BWD_KEYS),
                (mqp, ncols),
                pow2(t),
                (ws.ds2c.as_mut_ptr(), BWD_KEYS / 2),
                true,
            );
            let back = PairOut::Add(pow2(-t));
            crate::dot16::gemm_pairs(
                (nk, dqkp, at2.1),
                (ws.ds2r.as_ptr(), 1, BWD_KEYS),
                (ws.q2r[at2.0 * dqkp..].as_ptr(), dqkp),
                (ws.dk.as_mut_ptr(), dqkp, back),
            );
            // (part_rows gives mqp rows of dqkp floats that only this task
            // writes.)
            crate::dot16::gemm_pairs(
                (mqp, dqkp, n.div_ceil(2)),
                (ws.ds2c.as_ptr(), BWD_KEYS / 2, 1),
                (ws.k2r.as_ptr(), dqkp),
                (outs.part_rows(task, hh, i0, mqp), dqkp, back),
            );
            ds_done = true;
        }
    }
    ds_done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow2_is_exact() {
        for e in -126..=127 {
            assert_eq!(pow2(e) as f64, 2f64.powi(e), "{e}");
        }
    }

    #[test]
    fn ds_exp_takes_the_largest_below_2_pow_56_and_the_smallest_above_2_pow_minus_72() {
        for (max, min) in [
            (1.0f32, 1e-20f32),
            (3.0e5, 2.0e-30),
            (1e-30, 2e-38),
            (7.5, 7.5),
        ] {
            let t = ds_exp(max, min).expect("fits");
            let (hi, lo) = (max as f64 * 2f64.powi(t), min as f64 * 2f64.powi(t));
            assert!(
                hi < 2f64.powi(56) && lo >= 2f64.powi(-72),
                "{max} {min}: t={t}"
            );
            assert!(
                t <= 126 && (hi >= 2f64.powi(55) || t == 126),
                "{max} {min}: t={t}"
            );
        }
        // A span over 127 binades, subnormal, zero, non-finite: no.
        for (max, min) in [
            (1.0f32, 2f32.powi(-127)),
            (2f32.powi(100), 2f32.powi(-30)),
            (1.0, 1e-40),
            (0.0, 0.0),
            (f32::INFINITY, 1.0),
            (f32::NAN, 1.0),
        ] {
            assert_eq!(ds_exp(max, min), None, "{max} {min}");
        }
        // Exactly 128 binades apart, with the largest at 2^55: no; 127: yes.
        assert_eq!(ds_exp(2f32.powi(55), 2f32.powi(-73)), None);
        assert_eq!(ds_exp(2f32.powi(55), 2f32.powi(-72)), Some(0));
    }
}
