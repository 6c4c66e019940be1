//! The differential fuzz check: arbitrary bytes decoded into a problem
//! (every option, dtype and layout, offsets, windows up to `usize::MAX`,
//! lengths, out-of-range parameters) and its data (with NaN, infinities,
//! subnormals and values near the f32 limits), run on a backend and on the
//! f64 reference, then held to the contract.
//!
//! One decoder serves the coverage-guided target (`fuzz/`, libFuzzer
//! through `cargo xtask fuzz`) and the stable replay and random smoke
//! (`cargo xtask fuzz --stable`). What is checked:
//!
//! - bad input: when the reference refuses the problem, the backend refuses
//!   it too, with the same error variant (or `Unsupported`); when the
//!   reference accepts it, the backend does not fail except as
//!   `Unsupported`. Nothing panics.
//! - the result has the problem's dtype and length, and the LSE is
//!   returned iff asked for;
//! - on clean data (every value finite, a bias finite or `-inf`, scores
//!   of every pair within SEMANTICS §6's range of `2^126`), every row passes the suite's
//!   check ([`crate::check::compare`]): exact zeros and `-inf` on fully
//!   masked rows, finite rows where the reference is finite, and the
//!   derived error bound. Data with NaN or infinities is checked for the
//!   first two points only (where such values go is open in §6).

use crate::case::{Bcast, Case, CaseParams};
use crate::check::{check_output, run_forward};
use crate::tolerance::pair_magnitude;
use attn_spec::reference::Reference;
use attn_spec::{
    alibi_slopes, AttnError, AttnOptions, Backend, Backward, DType, HostData, MaskKind, Problem,
    Shape, TensorDesc, View,
};

/// The most `q_len * kv_len * (dqk + dv)` a decoded case has (per head).
const WORK: usize = 1 << 19;

/// Reads decisions off the input, then off a generator seeded by it.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
    state: u64,
}

impl<'a> Reader<'a> {
    fn new(data: &'a [u8]) -> Self {
        let state = data.iter().fold(0x243f_6a88_85a3_08d3u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        Reader { data, at: 0, state }
    }

    fn byte(&mut self) -> u8 {
        if let Some(&b) = self.data.get(self.at) {
            self.at += 1;
            return b;
        }
        // splitmix64 once the input is spent.
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as u8
    }

    fn bit(&mut self) -> bool {
        self.byte() & 1 == 1
    }

    /// `true` with probability about `n / 256`.
    fn chance(&mut self, n: u8) -> bool {
        self.byte() < n
    }

    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |x, _| (x << 8) | u64::from(self.byte()))
    }

    fn f32_raw(&mut self) -> f32 {
        f32::from_bits((0..4).fold(0, |x, _| (x << 8) | u32::from(self.byte())))
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[usize::from(self.byte()) % from.len()]
    }

    /// A sequence length: mostly short, sometimes past a tile or two.
    fn len(&mut self) -> usize {
        match self.byte() {
            x @ 0..=199 => usize::from(x) % 40,
            x @ 200..=249 => usize::from(x - 200) * 6,
            _ => self.pick(&[0, 1, 63, 64, 65, 129]),
        }
    }

    /// A head dimension: mostly small, sometimes a common or a large one.
    fn dim(&mut self) -> usize {
        match self.byte() {
            x @ 0..=229 => 1 + usize::from(x) % 24,
            _ => self.pick(&[32, 64, 72, 128, 256, 257, 320]),
        }
    }

    /// A window side, from 0 to `usize::MAX`.
    fn side(&mut self) -> Option<usize> {
        match self.byte() {
            x @ 0..=159 => Some(usize::from(x) % 12),
            160..=191 => None,
            192..=239 => Some(self.pick(&[
                39,
                40,
                300,
                u32::MAX as usize,
                i64::MAX as usize,
                i64::MAX as usize + 1,
                usize::MAX - 1,
                usize::MAX,
            ])),
            _ => Some(self.u64() as usize),
        }
    }

    /// A data value in [-1, 1].
    fn plain(&mut self) -> f64 {
        (f64::from(self.byte()) - 127.5) / 127.5
    }

    /// An extreme data value.
    fn special(&mut self) -> f64 {
        let raw = f64::from(self.f32_raw());
        self.pick(&[
            0.0,
            -0.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e-40,
            -3e-39,
            1e-7,
            3.0e38,
            -3.0e38,
            65504.0,
            -70000.0,
            3.0,
            -4.0,
            1e4,
            raw,
        ])
    }

    /// A float parameter (scale, soft-cap, slope, sink): usual values,
    /// odd ones and any f32.
    fn param(&mut self, usual: &[f32]) -> f32 {
        if self.chance(232) {
            self.pick(usual)
        } else {
            let raw = self.f32_raw();
            self.pick(&[
                0.0,
                -0.0,
                -1.0,
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                1e-30,
                1e30,
                f32::MAX,
                f32::MIN_POSITIVE / 4.0,
                raw,
            ])
        }
    }
}

/// A decoded fuzz input: a case (possibly an invalid problem) and whether
/// its data is clean enough for the error bound.
#[derive(Clone, Debug)]
pub struct Decoded {
    /// The problem and its host tensors.
    pub case: Case,
    /// Every value finite (a bias finite or `-inf`), every parameter
    /// finite, and every score within `2^126`: the full check applies.
    pub clean: bool,
    /// Clean, with data, sinks and the scale in `[-4, 4]` and scores below
    /// `1e4`: plain enough for the backward bound.
    pub plain: bool,
}

/// `n` values: plain data in [-1, 1], in one tensor of four with one to
/// three extreme values planted, in one of sixteen scaled into the
/// subnormal range, in one of sixteen scaled up by 2^10 to 2^40.
fn values(r: &mut Reader<'_>, n: usize) -> Vec<f64> {
    let mode = r.byte();
    let mut vals: Vec<f64> = (0..n).map(|_| r.plain()).collect();
    if n == 0 {
        return vals;
    }
    match mode {
        0..=63 => {
            for _ in 0..1 + mode % 3 {
                let at = (usize::from(r.byte()) << 8 | usize::from(r.byte())) % n;
                vals[at] = r.special();
            }
        }
        64..=79 => vals.iter_mut().for_each(|x| *x *= 2f64.powi(-130)),
        80..=95 => {
            let f = 2f64.powi(10 + i32::from(mode % 31));
            vals.iter_mut().for_each(|x| *x *= f);
        }
        _ => {}
    }
    vals
}

fn data(r: &mut Reader<'_>, dtype: DType, n: usize) -> HostData {
    HostData::from_f64(dtype, &values(r, n))
}

/// Decodes `bytes` into a case. Any input decodes; sizes stay small enough
/// for the reference to take milliseconds.
pub fn decode(bytes: &[u8]) -> Decoded {
    let mut r = Reader::new(bytes);
    let b0 = r.byte();
    let (batch, kv_heads, group) = (
        1 + usize::from(b0 & 1),
        1 + usize::from((b0 >> 1) & 1),
        1 + usize::from(b0 >> 2) % 3,
    );
    let (mut q_len, mut kv_len) = (r.len(), r.len());
    let dqk = r.dim();
    let dv = if r.bit() { dqk } else { r.dim() };
    // Long sequences or wide heads, not both: the f64 reference and the
    // backward bound cost `q_len * kv_len * (dqk + dv)` per head, and each
    // input should take milliseconds.
    while q_len * kv_len * (dqk + dv) > WORK {
        if q_len >= kv_len {
            q_len /= 2;
        } else {
            kv_len /= 2;
        }
    }
    // An invalid head count now and then: validation must name it.
    let q_heads = if r.chance(4) {
        kv_heads * group + 1
    } else {
        kv_heads * group
    };
    let shape = Shape::new(batch, q_heads, kv_heads, q_len, kv_len, dqk).with_head_dim_v(dv);
    let dtype = r.pick(&[DType::F32, DType::F16, DType::Bf16, DType::F32]);
    let mut p = Problem::new(shape, dtype);
    let bhsd = r.bit();
    if bhsd {
        p = p.bhsd();
    }
    let off = usize::from(r.byte() % 4);
    p.q = p.q.with_offset(off);
    p.k = p.k.with_offset(off);
    p.v = p.v.with_offset(off);
    let mut o = AttnOptions {
        mask: match r.byte() % 4 {
            0 => MaskKind::None,
            1 => MaskKind::Causal,
            _ => MaskKind::Window {
                left: r.side(),
                right: r.side(),
            },
        },
        ..AttnOptions::default()
    };
    if r.bit() {
        o = o.top_left();
    }
    if r.chance(40) {
        o.softcap = Some(r.param(&[5.0, 30.0, 0.5]));
    }
    if r.chance(60) {
        let big = (2f64.powi(126) / dqk as f64) as f32;
        o.scale = Some(r.param(&[0.125, 1.0, 1e-3, 3.0, big]));
    }
    o.return_lse = r.bit();
    let heads = |r: &mut Reader<'_>| if r.chance(6) { q_heads + 1 } else { q_heads };
    if r.chance(50) {
        let n = heads(&mut r);
        let std = alibi_slopes(n);
        o.alibi_slopes = Some(std.iter().map(|&s| r.param(&[s, s, 0.0, 0.5])).collect());
    }
    if r.chance(50) {
        let n = heads(&mut r);
        o.sinks = Some((0..n).map(|_| r.param(&[0.0, -2.0, 1.5])).collect());
    }
    let lens = |r: &mut Reader<'_>, len: usize| -> Option<Vec<usize>> {
        r.chance(70).then(|| {
            let n = if r.chance(6) { batch + 1 } else { batch };
            // Mostly within the padded size, sometimes one past it.
            (0..n).map(|_| usize::from(r.byte()) % (len + 2)).collect()
        })
    };
    o.q_lens = lens(&mut r, q_len);
    o.kv_lens = lens(&mut r, kv_len);
    p.options = o;
    let bcast = |r: &mut Reader<'_>| Bcast {
        per_batch: r.bit(),
        per_head: r.bit(),
    };
    let bview = |bc: Bcast| {
        View::contiguous([
            if bc.per_batch { batch } else { 1 },
            if bc.per_head { q_heads } else { 1 },
            q_len,
            kv_len,
        ])
    };
    let n = |v: &View| v.extent().unwrap_or(0);
    let (mut q, mut k, mut v) = (
        data(&mut r, dtype, n(&p.q)),
        data(&mut r, dtype, n(&p.k)),
        data(&mut r, dtype, n(&p.v)),
    );
    let bias = r.chance(60).then(|| {
        let view = bview(bcast(&mut r));
        let bdt = r.pick(&[dtype, dtype, DType::F32]);
        p.bias = Some(TensorDesc { view, dtype: bdt });
        let mut vals = values(&mut r, n(&view));
        for x in vals.iter_mut() {
            if r.chance(20) {
                *x = f64::NEG_INFINITY;
            }
        }
        HostData::from_f64(bdt, &vals)
    });
    let mask = r.chance(50).then(|| {
        let view = bview(bcast(&mut r));
        p.mask = Some(view);
        let keep = r.byte();
        HostData::Bool((0..n(&view)).map(|_| r.byte() <= keep).collect())
    });
    // Now and then one buffer one element short.
    if r.chance(6) {
        let cut = |d: &mut HostData| {
            let mut x = d.to_f64_vec();
            x.pop();
            *d = HostData::from_f64(d.dtype(), &x);
        };
        match r.byte() % 3 {
            0 => cut(&mut q),
            1 => cut(&mut k),
            _ => cut(&mut v),
        }
    }
    let mut params = CaseParams::plain(shape);
    params.dtype = dtype;
    params.bhsd = bhsd;
    params.offset = off;
    let case = Case {
        params,
        problem: p,
        q,
        k,
        v,
        bias,
        mask,
    };
    let (clean, plain) = cleanliness(&case);
    Decoded { case, clean, plain }
}

/// (clean, plain) of [`Decoded`].
fn cleanliness(case: &Case) -> (bool, bool) {
    let p = &case.problem;
    let o = &p.options;
    let finite = |d: &HostData| d.to_f64_vec().iter().all(|x| x.is_finite());
    let small = |d: &HostData| d.to_f64_vec().iter().all(|x| x.abs() <= 4.0);
    let params_ok = o.scale.is_none_or(f32::is_finite)
        && o.softcap.is_none_or(f32::is_finite)
        && o.alibi_slopes.iter().flatten().all(|x| x.is_finite())
        && o.sinks.iter().flatten().all(|x| x.is_finite());
    let bias_ok = case.bias.as_ref().is_none_or(|b| {
        b.to_f64_vec()
            .iter()
            .all(|&x| x.is_finite() || x == f64::NEG_INFINITY)
    });
    let data_ok = finite(&case.q) && finite(&case.k) && finite(&case.v);
    let fits = |v: &View, d: &HostData| v.extent().is_some_and(|n| n <= d.len());
    let buffers_ok = fits(&p.q, &case.q)
        && fits(&p.k, &case.k)
        && fits(&p.v, &case.v)
        && p.bias
            .zip(case.bias.as_ref())
            .is_none_or(|(b, d)| fits(&b.view, d))
        && p.mask
            .zip(case.mask.as_ref())
            .is_none_or(|(m, d)| fits(&m, d));
    if !(params_ok && bias_ok && data_ok && buffers_ok) || p.validate().is_err() {
        return (false, false);
    }
    let s = p.shape;
    let mut mag = 0.0f64;
    for b in 0..s.batch {
        let m = p.seq_mask(b);
        for h in 0..s.q_heads {
            for i in 0..s.q_len {
                // Every pair, excluded ones too: a tiled or dense kernel
                // computes those scores before it masks them.
                for j in 0..s.kv_len {
                    mag = mag.max(pair_magnitude(case, &m, (b, h, i, j)));
                }
            }
        }
    }
    // A sink is a score too (an extra column of every row).
    for &sk in o.sinks.iter().flatten() {
        mag = mag.max(f64::from(sk).abs());
    }
    let clean = mag <= 2f64.powi(126);
    let plain = clean
        && mag <= 1e4
        && small(&case.q)
        && small(&case.k)
        && small(&case.v)
        && o.sinks.iter().flatten().all(|x| x.abs() <= 4.0)
        // The scale multiplies every gradient of Q and K, whatever the
        // scores: a huge one overflows a 16-bit gradient.
        && o.scale.is_none_or(|x| x.abs() <= 4.0);
    (clean, plain)
}

/// Runs the decoded case on `backend` and holds it to the contract (see
/// the module's documentation). `Err` says what broke.
pub fn check<B: Backend>(backend: &B, d: &Decoded) -> Result<(), String> {
    let case = &d.case;
    let p = &case.problem;
    let ctx = |e: String| format!("{}: {e}\ncase: {}", backend.name(), case.describe());
    let want = Reference.forward(p, case.inputs());
    let got = backend
        .supports(p)
        .and_then(|()| run_forward(backend, case));
    let (out, lse) = match (want, got) {
        (_, Err(AttnError::Unsupported { .. })) => return Ok(()),
        (Err(w), Err(g)) => {
            if std::mem::discriminant(&w) == std::mem::discriminant(&g) {
                return Ok(());
            }
            return Err(ctx(format!("refused with `{g}`, the reference with `{w}`")));
        }
        (Err(w), Ok(_)) => return Err(ctx(format!("accepted input the reference refuses: {w}"))),
        (Ok(_), Err(g)) => return Err(ctx(format!("refused valid input: {g}"))),
        (Ok(_), Ok(x)) => x,
    };
    let n = p.out.extent().unwrap_or(0);
    if out.dtype() != p.dtype || out.len() != n {
        return Err(ctx(format!(
            "output of {} x {}, expected {} x {n}",
            out.dtype(),
            out.len(),
            p.dtype
        )));
    }
    if p.options.return_lse != lse.is_some() {
        return Err(ctx("log-sum-exp returned iff asked for: violated".into()));
    }
    if d.clean {
        check_output(case, &out, lse.as_ref()).map_err(ctx)?;
    }
    Ok(())
}

/// The backward pass of a decoded case with plain data on `backend`,
/// under the backward suite's bound; other cases are left to [`check`].
pub fn check_backward<B: Backward>(backend: &B, d: &Decoded) -> Result<(), String> {
    if !d.plain {
        return Ok(());
    }
    let bc = crate::backward::BackCase::of(d.case.clone());
    crate::backward::check_backward(backend, &bc).map(|_| ())
}
