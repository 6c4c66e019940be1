//! The options of one attention call: one struct with defaults and a builder,
//! never one function per combination of flags.
//!
//! Tensors that travel with a call (bias, boolean mask) are not options: they
//! live on the backend beside Q, K and V (see [`crate::Inputs`]) and are
//! described in [`crate::Problem`]. What is here is small host data: scalars,
//! per-head slopes and sinks, per-sequence lengths.

/// Which keys a query row may see, before per-sequence lengths and the
/// boolean mask are applied. See `docs/SEMANTICS.md`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MaskKind {
    /// Every key of the sequence.
    #[default]
    None,
    /// Keys up to the row's diagonal: a window with `left` infinite and
    /// `right` 0.
    Causal,
    /// Keys `j` with `c - left <= j <= c + right` (both ends inclusive), where
    /// `c` is the row's diagonal key; `None` means unbounded on that side.
    Window {
        /// Keys visible before the diagonal (`None`: all of them).
        left: Option<usize>,
        /// Keys visible after the diagonal (`None`: all of them).
        right: Option<usize>,
    },
}

impl MaskKind {
    /// The mask as a window `(left, right)`; `None` on a side is unbounded.
    pub fn window(self) -> (Option<usize>, Option<usize>) {
        match self {
            MaskKind::None => (None, None),
            MaskKind::Causal => (None, Some(0)),
            MaskKind::Window { left, right } => (left, right),
        }
    }
}

/// Where the diagonal of a rectangular (q_len != kv_len) mask sits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Alignment {
    /// The last query row's diagonal is the last key (`c = i + kv_len -
    /// q_len`): what KV-cache decoding and chunked prefill need, and what
    /// FlashAttention >= 2.1 does. The default.
    #[default]
    BottomRight,
    /// The first query row's diagonal is the first key (`c = i`): PyTorch
    /// SDPA's `is_causal`.
    TopLeft,
}

/// Options of an attention call. Build with `AttnOptions::default()` and the
/// chained setters, or a struct literal with `..Default::default()`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AttnOptions {
    /// Multiplier of `q . k`; `None` means `1 / sqrt(head_dim_qk)`.
    pub scale: Option<f32>,
    /// The mask kind (none, causal, sliding window).
    pub mask: MaskKind,
    /// Alignment of the causal/window diagonal (and of ALiBi distances).
    pub alignment: Alignment,
    /// Logit soft-capping `cap * tanh(s / cap)`, applied after scaling.
    pub softcap: Option<f32>,
    /// ALiBi slopes, one per query head: adds `-slope * |j - c|`.
    pub alibi_slopes: Option<Vec<f32>>,
    /// Attention sinks, one logit per query head, joining the softmax
    /// denominator only (as gpt-oss uses them).
    pub sinks: Option<Vec<f32>>,
    /// Valid query rows per batch entry (padded batches); rows beyond give
    /// output 0 and log-sum-exp -inf.
    pub q_lens: Option<Vec<usize>>,
    /// Valid keys per batch entry; keys beyond are masked.
    pub kv_lens: Option<Vec<usize>>,
    /// Whether to return the log-sum-exp of each row (`[batch, q_heads,
    /// q_len]`, f32).
    pub return_lse: bool,
}

impl AttnOptions {
    /// Sets the score scale.
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Causal mask.
    pub fn causal(mut self) -> Self {
        self.mask = MaskKind::Causal;
        self
    }
    /// Sliding window `(left, right)`, inclusive; `None` is unbounded.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.mask = MaskKind::Window { left, right };
        self
    }
    /// Sets the mask kind.
    pub fn mask(mut self, mask: MaskKind) -> Self {
        self.mask = mask;
        self
    }
    /// Aligns the diagonal top-left instead of bottom-right.
    pub fn top_left(mut self) -> Self {
        self.alignment = Alignment::TopLeft;
        self
    }
    /// Sets the alignment.
    pub fn alignment(mut self, alignment: Alignment) -> Self {
        self.alignment = alignment;
        self
    }
    /// Logit soft-capping with `cap > 0`.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }
    /// ALiBi slopes, one per query head.
    pub fn alibi(mut self, slopes: Vec<f32>) -> Self {
        self.alibi_slopes = Some(slopes);
        self
    }
    /// Attention sinks, one logit per query head.
    pub fn sinks(mut self, sinks: Vec<f32>) -> Self {
        self.sinks = Some(sinks);
        self
    }
    /// Valid query rows per batch entry.
    pub fn q_lens(mut self, lens: Vec<usize>) -> Self {
        self.q_lens = Some(lens);
        self
    }
    /// Valid keys per batch entry.
    pub fn kv_lens(mut self, lens: Vec<usize>) -> Self {
        self.kv_lens = Some(lens);
        self
    }
    /// Also return the log-sum-exp per row.
    pub fn with_lse(mut self) -> Self {
        self.return_lse = true;
        self
    }
}

/// The ALiBi slopes of the original paper for `heads` heads: a geometric
/// sequence starting at `2^(-8/n)` for the nearest power of two `n`, with the
/// interleaving the paper uses when `heads` is not a power of two.
pub fn alibi_slopes(heads: usize) -> Vec<f32> {
    fn pow2(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-8.0 / n as f64);
        (0..n).map(|i| start.powi(i as i32 + 1)).collect()
    }
    if heads == 0 {
        return Vec::new();
    }
    let n = 1usize << heads.ilog2();
    let mut s = pow2(n);
    if n < heads {
        s.extend(pow2(2 * n).into_iter().step_by(2).take(heads - n));
    }
    s.into_iter().map(|x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_sets_fields() {
        let o = AttnOptions::default()
            .causal()
            .top_left()
            .scale(0.5)
            .softcap(30.0)
            .with_lse();
        assert_eq!(o.mask, MaskKind::Causal);
        assert_eq!(o.alignment, Alignment::TopLeft);
        assert_eq!(o.scale, Some(0.5));
        assert_eq!(o.softcap, Some(30.0));
        assert!(o.return_lse);
        assert_eq!(MaskKind::Causal.window(), (None, Some(0)));
    }

    #[test]
    fn alibi_slopes_match_the_paper() {
        let s = alibi_slopes(8);
        let want: Vec<f32> = (1..=8).map(|i| 2f32.powi(-i)).collect();
        assert_eq!(s, want);
        // 12 heads: the 8 slopes of n=8, then odd entries of n=16.
        let s12 = alibi_slopes(12);
        assert_eq!(s12.len(), 12);
        assert_eq!(s12[8], 2f32.powf(-0.5));
        assert_eq!(s12[9], 2f32.powf(-1.5));
    }
}
