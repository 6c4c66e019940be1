//! Attention maps: the probabilities `P = softmax(scores, masked)` that a
//! fused kernel never forms, recomputed on request from the log-sum-exp of
//! a forward call (`P_ij = exp(x_ij - lse_i)`, `x` the score of
//! `docs/SEMANTICS.md` steps 1-5), for a chosen part of the problem only.
//!
//! A request ([`MapRequest`]) selects batch entries, query heads and a
//! range of query rows (default: all) and may average the selected heads
//! (PyTorch's `need_weights=True, average_attn_weights=True`). The result
//! is f32, contiguous `[batches, heads, rows, kv_len]` (`heads` is 1 when
//! averaged), laid out as [`MapLayout`] says. Entries a mask, window,
//! sequence length or `-inf` bias hides are exactly 0; a row sums to 1, or
//! to `1 - exp(sink - lse)` with a sink; a row that sees nothing is all 0.
//!
//! Memory is what was asked for, checked against the request's budget
//! before anything is allocated: a 32k x 32k map of one head is 4 GiB, and
//! a request over budget is an [`AttnError::OverBudget`] that says so.

use crate::backend::{Backend, Inputs};
use crate::dtype::DType;
use crate::error::{AttnError, Result};
use crate::problem::{Buffers, Problem};
use std::ops::Range;

/// The default budget of a map request: 1 GiB.
pub const DEFAULT_MAP_BUDGET: u128 = 1 << 30;

/// Which attention probabilities to return. Selected batch entries and
/// heads are crossed: the map holds every (batch, head) pair of the two
/// lists, in list order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapRequest {
    /// Batch entries (`None`: all).
    pub batches: Option<Vec<usize>>,
    /// Query heads (`None`: all).
    pub heads: Option<Vec<usize>>,
    /// Query rows (`None`: all).
    pub rows: Option<Range<usize>>,
    /// Average the selected heads into one map per batch entry.
    pub average_heads: bool,
    /// The most bytes the maps may take ([`DEFAULT_MAP_BUDGET`]).
    pub budget: u128,
}

impl Default for MapRequest {
    fn default() -> Self {
        MapRequest {
            batches: None,
            heads: None,
            rows: None,
            average_heads: false,
            budget: DEFAULT_MAP_BUDGET,
        }
    }
}

impl MapRequest {
    /// Every batch entry, head and row; heads not averaged.
    pub fn all() -> Self {
        Self::default()
    }
    /// Only these batch entries.
    pub fn batches(mut self, b: impl Into<Vec<usize>>) -> Self {
        self.batches = Some(b.into());
        self
    }
    /// Only these query heads.
    pub fn heads(mut self, h: impl Into<Vec<usize>>) -> Self {
        self.heads = Some(h.into());
        self
    }
    /// Only these query rows.
    pub fn rows(mut self, r: Range<usize>) -> Self {
        self.rows = Some(r);
        self
    }
    /// The mean over the selected heads instead of one map per head.
    pub fn averaged(mut self) -> Self {
        self.average_heads = true;
        self
    }
    /// A budget of `bytes`.
    pub fn with_budget(mut self, bytes: u128) -> Self {
        self.budget = bytes;
        self
    }

    /// The concrete selection for `problem`: every index in range, at
    /// least one batch entry and head, and the maps within the budget.
    pub fn resolve(&self, problem: &Problem) -> Result<MapLayout> {
        let s = problem.shape;
        let pick = |sel: &Option<Vec<usize>>, len: usize, what: &'static str| {
            let v: Vec<usize> = sel.clone().unwrap_or_else(|| (0..len).collect());
            if v.is_empty() {
                return Err(AttnError::ZeroSize { what });
            }
            match v.iter().find(|&&x| x >= len) {
                Some(&index) => Err(AttnError::OutOfRange { what, index, len }),
                None => Ok(v),
            }
        };
        let batches = pick(&self.batches, s.batch, "maps: batch entry")?;
        let heads = pick(&self.heads, s.q_heads, "maps: query head")?;
        let rows = self.rows.clone().unwrap_or(0..s.q_len);
        if rows.end > s.q_len {
            return Err(AttnError::OutOfRange {
                what: "maps: end of the query rows",
                index: rows.end,
                len: s.q_len,
            });
        }
        let rows = rows.start.min(rows.end)..rows.end;
        let layout = MapLayout {
            batches,
            heads,
            rows,
            kv_len: s.kv_len,
            averaged: self.average_heads,
        };
        let dims = layout.dims();
        let needed = dims.iter().fold(4u128, |a, &d| a * d as u128);
        if needed > self.budget {
            return Err(AttnError::OverBudget {
                what: format!("attention maps {dims:?} of f32"),
                needed,
                budget: self.budget,
                hint: "select fewer batch entries, heads or query rows, average the heads \
                       (MapRequest::averaged), or raise the budget (MapRequest::with_budget)",
            });
        }
        if usize::try_from(needed).is_err() {
            return Err(AttnError::Overflow {
                what: "the attention maps' size",
            });
        }
        Ok(layout)
    }
}

/// A resolved map request: what the map buffer holds, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapLayout {
    /// The batch entries, in map order.
    pub batches: Vec<usize>,
    /// The query heads, in map order (averaged into one when `averaged`).
    pub heads: Vec<usize>,
    /// The query rows.
    pub rows: Range<usize>,
    /// Keys per row (the problem's `kv_len`).
    pub kv_len: usize,
    /// Whether the heads are averaged.
    pub averaged: bool,
}

impl MapLayout {
    /// `[batches, heads (1 when averaged), rows, kv_len]`.
    pub fn dims(&self) -> [usize; 4] {
        let h = if self.averaged { 1 } else { self.heads.len() };
        [self.batches.len(), h, self.rows.len(), self.kv_len]
    }

    /// Elements of the map buffer.
    pub fn len(&self) -> usize {
        self.dims().iter().product()
    }

    /// Whether the map holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where map row `r` (0-based within [`MapLayout::rows`]) of selected
    /// batch `bi` and selected head `hi` starts (`hi` is 0 when averaged).
    pub fn row_start(&self, bi: usize, hi: usize, r: usize) -> usize {
        let [_, nh, nr, kl] = self.dims();
        ((bi * nh + hi) * nr + r) * kl
    }
}

/// Maps and their layout, as [`AttentionMaps::maps`] returns them.
#[derive(Debug)]
pub struct Maps<B> {
    /// f32, contiguous, laid out as `layout`.
    pub probs: B,
    /// What `probs` holds.
    pub layout: MapLayout,
}

/// A backend that returns attention maps.
pub trait AttentionMaps: Backend {
    /// Writes the maps `layout` selects into `maps` (f32, `layout.len()`
    /// elements), from the forward's log-sum-exp `lse` (f32 `[batch,
    /// q_heads, q_len]`, [`Problem::lse_view`]). Implementations start
    /// with [`check_maps_call`].
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        lse: &Self::Buffer,
        layout: &MapLayout,
        maps: &mut Self::Buffer,
    ) -> Result<()>;

    /// The maps `request` asks for: checked against the budget first,
    /// then recomputed from `lse`, or from the log-sum-exp of a forward
    /// call made here when `lse` is `None`.
    fn maps(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        lse: Option<&Self::Buffer>,
        request: &MapRequest,
    ) -> Result<Maps<Self::Buffer>> {
        problem.validate()?;
        let layout = request.resolve(problem)?;
        let owned;
        let lse = match lse {
            Some(l) => l,
            None => {
                let mut p = problem.clone();
                p.options.return_lse = true;
                owned = self.forward(&p, inputs)?.lse;
                owned.as_ref().ok_or(AttnError::Missing {
                    tensor: "lse",
                    what: "the forward call returned no log-sum-exp",
                })?
            }
        };
        let mut probs = self.zeros(DType::F32, layout.len())?;
        self.maps_into(problem, inputs, lse, &layout, &mut probs)?;
        Ok(Maps { probs, layout })
    }
}

/// A reference to a backend with maps has maps (so a layer can borrow one).
impl<B: AttentionMaps + ?Sized> AttentionMaps for &B {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        lse: &Self::Buffer,
        layout: &MapLayout,
        maps: &mut Self::Buffer,
    ) -> Result<()> {
        (**self).maps_into(problem, inputs, lse, layout, maps)
    }
}

/// The check every `maps_into` runs first: the problem and its inputs,
/// the log-sum-exp (f32, long enough), the layout against the problem
/// (indices in range; the budget was the request's business), the map
/// buffer (f32, exactly `layout.len()` elements), then whether the
/// backend supports the problem.
pub fn check_maps_call<B: Backend + ?Sized>(
    backend: &B,
    problem: &Problem,
    inputs: &Inputs<'_, B::Buffer>,
    lse: &B::Buffer,
    layout: &MapLayout,
    maps: &B::Buffer,
) -> Result<()> {
    let info = |b: &B::Buffer| backend.info(b);
    let mut p = problem.clone();
    p.options.return_lse = true;
    p.validate_buffers(&Buffers {
        q: info(inputs.q),
        k: info(inputs.k),
        v: info(inputs.v),
        bias: inputs.bias.map(info),
        mask: inputs.mask.map(info),
        out: None,
        lse: Some(info(lse)),
    })?;
    let again = MapRequest {
        batches: Some(layout.batches.clone()),
        heads: Some(layout.heads.clone()),
        rows: Some(layout.rows.clone()),
        average_heads: layout.averaged,
        budget: u128::MAX,
    }
    .resolve(problem)?;
    if again != *layout {
        return Err(AttnError::Shape {
            tensor: "maps",
            axis: "keys",
            expected: problem.shape.kv_len,
            got: layout.kv_len,
        });
    }
    let m = info(maps);
    if m.dtype != DType::F32 {
        return Err(AttnError::DType {
            tensor: "maps",
            expected: "f32".into(),
            got: m.dtype,
        });
    }
    if m.len != layout.len() {
        return Err(AttnError::Shape {
            tensor: "maps",
            axis: "elements",
            expected: layout.len(),
            got: m.len,
        });
    }
    backend.supports(problem)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;

    fn problem() -> Problem {
        Problem::new(Shape::new(2, 4, 2, 5, 7, 8), DType::F32)
    }

    #[test]
    fn a_request_resolves_to_its_selection() {
        let l = MapRequest::all().resolve(&problem()).unwrap();
        assert_eq!(l.dims(), [2, 4, 5, 7]);
        let l = MapRequest::all()
            .batches([1])
            .heads([3, 0])
            .rows(1..4)
            .resolve(&problem())
            .unwrap();
        assert_eq!(l.dims(), [1, 2, 3, 7]);
        assert_eq!(l.row_start(0, 1, 2), (3 + 2) * 7);
        let l = MapRequest::all().averaged().resolve(&problem()).unwrap();
        assert_eq!(l.dims(), [2, 1, 5, 7]);
    }

    #[test]
    fn bad_selections_are_named() {
        let p = problem();
        let e = MapRequest::all().heads([4]).resolve(&p).unwrap_err();
        assert_eq!(
            e,
            AttnError::OutOfRange {
                what: "maps: query head",
                index: 4,
                len: 4
            }
        );
        let e = MapRequest::all().batches([0, 2]).resolve(&p).unwrap_err();
        assert!(matches!(
            e,
            AttnError::OutOfRange {
                index: 2,
                len: 2,
                ..
            }
        ));
        let e = MapRequest::all().rows(0..6).resolve(&p).unwrap_err();
        assert!(matches!(
            e,
            AttnError::OutOfRange {
                index: 6,
                len: 5,
                ..
            }
        ));
        let e = MapRequest::all().heads([]).resolve(&p).unwrap_err();
        assert!(matches!(e, AttnError::ZeroSize { .. }));
    }

    /// One head of a 32k x 32k map is 4 GiB: over the default budget,
    /// and the error says how much and what to do.
    #[test]
    fn a_map_over_budget_is_refused_before_allocating() {
        let p = Problem::new(Shape::new(1, 8, 8, 32768, 32768, 64), DType::Bf16);
        let e = MapRequest::all().heads([0]).resolve(&p).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, AttnError::OverBudget { needed, .. } if needed == 1 << 32));
        assert!(
            msg.contains("4.00 GiB") && msg.contains("1.00 GiB"),
            "{msg}"
        );
        assert!(
            msg.contains("[1, 1, 32768, 32768]") && msg.contains("averaged"),
            "{msg}"
        );
        let ok = MapRequest::all()
            .heads([0])
            .with_budget(1 << 32)
            .resolve(&p);
        assert_eq!(ok.unwrap().len(), 1 << 30);
        // Averaging all eight heads costs one head's map.
        let avg = MapRequest::all()
            .averaged()
            .with_budget(1 << 32)
            .resolve(&p);
        assert_eq!(avg.unwrap().dims(), [1, 1, 32768, 32768]);
    }
}
