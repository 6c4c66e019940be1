//! The problem: shapes, the strided views of every tensor, the element type,
//! and the options. [`Problem::validate`] is the one validation every
//! backend calls first; after it, no index computed from the problem can
//! leave a buffer and no size arithmetic can overflow.

use crate::dtype::DType;
use crate::error::{AttnError, Result};
use crate::mask::SeqMask;
use crate::options::AttnOptions;
use crate::tensor::View;

/// The sizes of an attention problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Batch entries.
    pub batch: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key/value heads (`q_heads / kv_heads` query heads share each).
    pub kv_heads: usize,
    /// Query rows (padded length when `q_lens` is given).
    pub q_len: usize,
    /// Keys (padded length when `kv_lens` is given).
    pub kv_len: usize,
    /// Head dimension of Q and K.
    pub head_dim_qk: usize,
    /// Head dimension of V and the output.
    pub head_dim_v: usize,
}

impl Shape {
    /// A shape with one head dimension for Q, K and V.
    pub fn new(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        q_len: usize,
        kv_len: usize,
        head_dim: usize,
    ) -> Self {
        Shape {
            batch,
            q_heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim_qk: head_dim,
            head_dim_v: head_dim,
        }
    }

    /// The same shape with a different head dimension for V.
    pub fn with_head_dim_v(mut self, head_dim_v: usize) -> Self {
        self.head_dim_v = head_dim_v;
        self
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads.max(1)
    }

    /// The key/value head that query head `h` reads.
    #[inline]
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group().max(1)
    }
}

/// A tensor's view and element type (for the bias, whose type may differ
/// from Q's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// The strided view.
    pub view: View,
    /// The element type.
    pub dtype: DType,
}

/// Element type and length of a buffer, as a backend reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferInfo {
    /// The element type.
    pub dtype: DType,
    /// Number of elements.
    pub len: usize,
}

/// One attention call, fully described.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    /// The sizes.
    pub shape: Shape,
    /// Element type of Q, K, V and the output.
    pub dtype: DType,
    /// Q, logical `(batch, q_len, q_heads, head_dim_qk)`.
    pub q: View,
    /// K, logical `(batch, kv_len, kv_heads, head_dim_qk)`.
    pub k: View,
    /// V, logical `(batch, kv_len, kv_heads, head_dim_v)`.
    pub v: View,
    /// Output, logical `(batch, q_len, q_heads, head_dim_v)`.
    pub out: View,
    /// Additive bias, logical `(batch or 1, q_heads or 1, q_len, kv_len)`.
    pub bias: Option<TensorDesc>,
    /// Boolean mask (`true` = take part), logical `(batch or 1, q_heads or
    /// 1, q_len, kv_len)`.
    pub mask: Option<View>,
    /// The options.
    pub options: AttnOptions,
}

impl Problem {
    /// A problem with contiguous `[batch, seq, heads, dim]` tensors and
    /// default options.
    pub fn new(shape: Shape, dtype: DType) -> Self {
        let s = shape;
        Problem {
            shape,
            dtype,
            q: View::bshd(s.batch, s.q_len, s.q_heads, s.head_dim_qk),
            k: View::bshd(s.batch, s.kv_len, s.kv_heads, s.head_dim_qk),
            v: View::bshd(s.batch, s.kv_len, s.kv_heads, s.head_dim_v),
            out: View::bshd(s.batch, s.q_len, s.q_heads, s.head_dim_v),
            bias: None,
            mask: None,
            options: AttnOptions::default(),
        }
    }

    /// The same problem with all four tensors in `[batch, heads, seq, dim]`.
    pub fn bhsd(mut self) -> Self {
        let s = self.shape;
        self.q = View::bhsd(s.batch, s.q_len, s.q_heads, s.head_dim_qk);
        self.k = View::bhsd(s.batch, s.kv_len, s.kv_heads, s.head_dim_qk);
        self.v = View::bhsd(s.batch, s.kv_len, s.kv_heads, s.head_dim_v);
        self.out = View::bhsd(s.batch, s.q_len, s.q_heads, s.head_dim_v);
        self
    }

    /// Sets the options.
    pub fn with_options(mut self, options: AttnOptions) -> Self {
        self.options = options;
        self
    }

    /// Adds an additive bias of element type `dtype`.
    pub fn with_bias(mut self, view: View, dtype: DType) -> Self {
        self.bias = Some(TensorDesc { view, dtype });
        self
    }

    /// Adds a boolean mask.
    pub fn with_mask(mut self, view: View) -> Self {
        self.mask = Some(view);
        self
    }

    /// The effective score scale as a backend computes with it: the given
    /// scale, or `1/sqrt(Dqk)` rounded to the nearest f32 (SEMANTICS §3).
    pub fn scale(&self) -> f32 {
        self.options
            .scale
            .unwrap_or_else(|| self.scale_exact() as f32)
    }

    /// The effective score scale exactly, as the f64 oracle uses it: the
    /// given (f32) scale, or `1/sqrt(Dqk)` in f64 (correctly rounded: IEEE
    /// `sqrt` and division), not rounded to f32.
    pub fn scale_exact(&self) -> f64 {
        self.options
            .scale
            .map_or_else(|| 1.0 / (self.shape.head_dim_qk as f64).sqrt(), f64::from)
    }

    /// Valid `(q_len, kv_len)` of batch entry `b`.
    pub fn seq_lens(&self, b: usize) -> (usize, usize) {
        let o = &self.options;
        let ql = o.q_lens.as_ref().map_or(self.shape.q_len, |l| l[b]);
        let kl = o.kv_lens.as_ref().map_or(self.shape.kv_len, |l| l[b]);
        (ql, kl)
    }

    /// The masking model of batch entry `b`.
    pub fn seq_mask(&self, b: usize) -> SeqMask {
        let (ql, kl) = self.seq_lens(b);
        SeqMask::new(self.options.mask, self.options.alignment, ql, kl)
    }

    /// The view of the log-sum-exp output: contiguous `[batch, q_heads,
    /// q_len]` (a trailing axis of 1), f32.
    pub fn lse_view(&self) -> View {
        let s = self.shape;
        View::contiguous([s.batch, s.q_heads, s.q_len, 1])
    }

    /// Floating-point operations of the visible pairs only: `2 * (d_qk +
    /// d_v)` per pair (a multiply and an add per element of `q . k` and of
    /// `p v`), so masked work is never counted.
    pub fn flops(&self) -> f64 {
        let per_pair = 2.0 * (self.shape.head_dim_qk + self.shape.head_dim_v) as f64;
        let pairs: u64 = (0..self.shape.batch)
            .map(|b| self.seq_mask(b).visible_pairs())
            .sum();
        pairs as f64 * self.shape.q_heads as f64 * per_pair
    }

    /// Checks the problem itself: sizes, views, options. Every backend calls
    /// this (through [`Problem::validate_buffers`]) before anything else.
    pub fn validate(&self) -> Result<()> {
        let s = &self.shape;
        for (what, v) in [
            ("batch", s.batch),
            ("q_heads", s.q_heads),
            ("kv_heads", s.kv_heads),
            ("head_dim_qk", s.head_dim_qk),
            ("head_dim_v", s.head_dim_v),
        ] {
            if v == 0 {
                return Err(AttnError::ZeroSize { what });
            }
        }
        if !s.q_heads.is_multiple_of(s.kv_heads) {
            return Err(AttnError::HeadsNotDivisible {
                q_heads: s.q_heads,
                kv_heads: s.kv_heads,
            });
        }
        if !matches!(
            self.dtype,
            DType::F32 | DType::F16 | DType::Bf16 | DType::F64
        ) {
            return Err(AttnError::DType {
                tensor: "q",
                expected: "f32, f16, bf16 or f64".into(),
                got: self.dtype,
            });
        }
        const QKV_AXES: [&str; 4] = ["batch", "seq", "heads", "head_dim"];
        let exact = [
            ("q", &self.q, [s.batch, s.q_len, s.q_heads, s.head_dim_qk]),
            ("k", &self.k, [s.batch, s.kv_len, s.kv_heads, s.head_dim_qk]),
            ("v", &self.v, [s.batch, s.kv_len, s.kv_heads, s.head_dim_v]),
            (
                "out",
                &self.out,
                [s.batch, s.q_len, s.q_heads, s.head_dim_v],
            ),
        ];
        for (tensor, view, want) in exact {
            check_view(tensor, view, QKV_AXES, want, false)?;
        }
        if self.out.may_alias() {
            return Err(AttnError::Aliasing { tensor: "out" });
        }
        let full = [s.batch, s.q_heads, s.q_len, s.kv_len];
        let bias = self.bias.as_ref().map(|d| ("bias", &d.view));
        let mask = self.mask.as_ref().map(|v| ("mask", v));
        for (tensor, view) in bias.into_iter().chain(mask) {
            check_view(
                tensor,
                view,
                ["batch", "heads", "q_len", "kv_len"],
                full,
                true,
            )?;
        }
        if let Some(d) = &self.bias {
            if !d.dtype.is_float() {
                return Err(AttnError::DType {
                    tensor: "bias",
                    expected: "a float type".into(),
                    got: d.dtype,
                });
            }
        }
        self.validate_options()?;
        // Sizes that kernels multiply: make sure none overflows.
        let pairs = [s.batch, s.q_heads, s.q_len, s.kv_len]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d));
        pairs
            .and_then(|p| p.checked_mul(s.head_dim_qk + s.head_dim_v))
            .ok_or(AttnError::Overflow {
                what: "batch * heads * q_len * kv_len * head dims",
            })?;
        Ok(())
    }

    fn validate_options(&self) -> Result<()> {
        let s = &self.shape;
        let o = &self.options;
        if let Some(scale) = o.scale {
            if !scale.is_finite() {
                return Err(AttnError::Parameter {
                    what: "scale",
                    value: scale.into(),
                    reason: "must be finite",
                });
            }
        }
        if let Some(cap) = o.softcap {
            if !(cap > 0.0 && cap.is_finite()) {
                return Err(AttnError::Parameter {
                    what: "softcap",
                    value: cap.into(),
                    reason: "must be positive and finite",
                });
            }
        }
        for (option, v) in [("alibi_slopes", &o.alibi_slopes), ("sinks", &o.sinks)] {
            if let Some(v) = v {
                if v.len() != s.q_heads {
                    return Err(AttnError::OptionLength {
                        option,
                        expected: s.q_heads,
                        got: v.len(),
                    });
                }
            }
        }
        for (option, v, max) in [
            ("q_lens", &o.q_lens, s.q_len),
            ("kv_lens", &o.kv_lens, s.kv_len),
        ] {
            if let Some(v) = v {
                if v.len() != s.batch {
                    return Err(AttnError::OptionLength {
                        option,
                        expected: s.batch,
                        got: v.len(),
                    });
                }
                if let Some((batch, &len)) = v.iter().enumerate().find(|(_, &l)| l > max) {
                    return Err(AttnError::SeqLen {
                        option,
                        batch,
                        len,
                        max,
                    });
                }
            }
        }
        Ok(())
    }

    /// [`Problem::validate`], then checks each buffer's element type and
    /// length against its view. `bias` and `mask` must be present exactly
    /// when the problem describes them; `out` and `lse` are checked when
    /// given.
    pub fn validate_buffers(&self, b: &Buffers) -> Result<()> {
        self.validate()?;
        let f32_name = "f32";
        let same = format!("{} (the problem's dtype)", self.dtype);
        let mut list: Vec<(&'static str, BufferInfo, View, DType, &str)> = vec![
            ("q", b.q, self.q, self.dtype, &same),
            ("k", b.k, self.k, self.dtype, &same),
            ("v", b.v, self.v, self.dtype, &same),
        ];
        if let Some(o) = b.out {
            list.push(("out", o, self.out, self.dtype, &same));
        }
        if let Some(l) = b.lse {
            if !self.options.return_lse {
                return Err(AttnError::Missing {
                    tensor: "lse",
                    what: "a buffer was given but options.return_lse is false",
                });
            }
            list.push(("lse", l, self.lse_view(), DType::F32, f32_name));
        }
        let bias_name;
        match (&self.bias, b.bias) {
            (Some(d), Some(info)) => {
                bias_name = d.dtype.to_string();
                list.push(("bias", info, d.view, d.dtype, &bias_name));
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(AttnError::Missing {
                    tensor: "bias",
                    what: "the problem describes a bias but no buffer was given",
                })
            }
            (None, Some(_)) => {
                return Err(AttnError::Missing {
                    tensor: "bias",
                    what: "a buffer was given but the problem describes no bias",
                })
            }
        }
        match (&self.mask, b.mask) {
            (Some(v), Some(info)) => list.push(("mask", info, *v, DType::Bool, "bool")),
            (None, None) => {}
            (Some(_), None) => {
                return Err(AttnError::Missing {
                    tensor: "mask",
                    what: "the problem describes a mask but no buffer was given",
                })
            }
            (None, Some(_)) => {
                return Err(AttnError::Missing {
                    tensor: "mask",
                    what: "a buffer was given but the problem describes no mask",
                })
            }
        }
        for (tensor, info, view, dtype, name) in list {
            if info.dtype != dtype {
                return Err(AttnError::DType {
                    tensor,
                    expected: name.to_string(),
                    got: info.dtype,
                });
            }
            let needed = view.extent().ok_or(AttnError::Overflow {
                what: "a view's extent",
            })?;
            if info.len < needed {
                return Err(AttnError::BufferTooSmall {
                    tensor,
                    needed,
                    len: info.len,
                });
            }
        }
        Ok(())
    }
}

/// The buffers of one call, as their element types and lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buffers {
    /// Q.
    pub q: BufferInfo,
    /// K.
    pub k: BufferInfo,
    /// V.
    pub v: BufferInfo,
    /// The bias, when given.
    pub bias: Option<BufferInfo>,
    /// The boolean mask, when given.
    pub mask: Option<BufferInfo>,
    /// The output, when given.
    pub out: Option<BufferInfo>,
    /// The log-sum-exp output, when given.
    pub lse: Option<BufferInfo>,
}

/// Checks a view's dims against `want` (with `broadcast`, the first two
/// axes may also be 1) and that its element count and extent fit `usize`.
fn check_view(
    tensor: &'static str,
    view: &View,
    axes: [&'static str; 4],
    want: [usize; 4],
    broadcast: bool,
) -> Result<()> {
    for a in 0..4 {
        let ok = view.dims[a] == want[a] || (broadcast && a < 2 && view.dims[a] == 1);
        if !ok {
            return Err(AttnError::Shape {
                tensor,
                axis: axes[a],
                expected: want[a],
                got: view.dims[a],
            });
        }
    }
    view.numel().ok_or(AttnError::Overflow {
        what: "a tensor's element count",
    })?;
    view.extent().ok_or(AttnError::Overflow {
        what: "a view's extent",
    })?;
    Ok(())
}
