//! One head's map: probabilities, hidden pairs, labels.

use crate::VizError;
use attn_spec::{MapLayout, Problem};

/// One head's `rows x keys` attention map, ready to draw.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadMap {
    /// A title (e.g. `"layer 1, head 3"`).
    pub title: String,
    /// Query rows.
    pub rows: usize,
    /// Keys.
    pub keys: usize,
    /// Row-major probabilities, `rows * keys`.
    pub probs: Vec<f32>,
    /// Row-major: the pair is hidden (masked, outside the window, padding);
    /// empty when nothing is.
    pub hidden: Vec<bool>,
    /// One label per row (empty: row numbers).
    pub row_labels: Vec<String>,
    /// One label per key (empty: key numbers).
    pub key_labels: Vec<String>,
}

impl HeadMap {
    /// A map of `rows x keys` probabilities, nothing hidden, numbered axes.
    pub fn new(
        title: impl Into<String>,
        rows: usize,
        keys: usize,
        probs: Vec<f32>,
    ) -> Result<Self, VizError> {
        if rows.checked_mul(keys) != Some(probs.len()) {
            return Err(VizError::Input(format!(
                "{} probabilities for {rows} rows x {keys} keys",
                probs.len()
            )));
        }
        Ok(HeadMap {
            title: title.into(),
            rows,
            keys,
            probs,
            hidden: Vec::new(),
            row_labels: Vec::new(),
            key_labels: Vec::new(),
        })
    }

    /// The map of selected batch entry `bi` and selected head `hi` (0 when
    /// averaged) out of a whole map buffer laid out as `layout` says.
    pub fn from_maps(
        title: impl Into<String>,
        maps: &[f32],
        layout: &MapLayout,
        bi: usize,
        hi: usize,
    ) -> Result<Self, VizError> {
        let [nb, nh, nr, kl] = layout.dims();
        if maps.len() != layout.len() || bi >= nb || hi >= nh {
            return Err(VizError::Input(format!(
                "map ({bi}, {hi}) of a {} element buffer laid out as {:?}",
                maps.len(),
                layout.dims()
            )));
        }
        let at = layout.row_start(bi, hi, 0);
        let mut m = HeadMap::new(title, nr, kl, maps[at..at + nr * kl].to_vec())?;
        m.row_labels = layout.rows.clone().map(|i| i.to_string()).collect();
        Ok(m)
    }

    /// Marks the pairs `hidden(row, key)` returns true for.
    pub fn with_hidden(mut self, hidden: impl Fn(usize, usize) -> bool) -> Self {
        self.hidden = (0..self.rows)
            .flat_map(|i| (0..self.keys).map(move |j| (i, j)))
            .map(|(i, j)| hidden(i, j))
            .collect();
        self
    }

    /// Marks the pairs `problem` hides for batch entry `batch` (causal
    /// mask, window, per-sequence lengths: the [`attn_spec::SeqMask`]),
    /// the map's first row being query row `first_row`.
    pub fn with_problem(self, problem: &Problem, batch: usize, first_row: usize) -> Self {
        let m = problem.seq_mask(batch);
        self.with_hidden(|i, j| !m.visible(first_row + i, j))
    }

    /// Labels the rows and keys (e.g. with tokens). Labels of the wrong
    /// count are refused when drawing.
    pub fn with_tokens(mut self, rows: &[&str], keys: &[&str]) -> Self {
        self.row_labels = rows.iter().map(|s| s.to_string()).collect();
        self.key_labels = keys.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Whether pair `(i, j)` is hidden.
    pub fn is_hidden(&self, i: usize, j: usize) -> bool {
        !self.hidden.is_empty() && self.hidden[i * self.keys + j]
    }

    /// The largest probability of a pair not hidden (0 when none).
    pub fn max_weight(&self) -> f32 {
        let mut m = 0.0f32;
        for i in 0..self.rows {
            for j in 0..self.keys {
                let p = self.probs[i * self.keys + j];
                if !self.is_hidden(i, j) && p > m {
                    m = p;
                }
            }
        }
        m
    }

    /// Checks sizes and labels.
    pub fn check(&self) -> Result<(), VizError> {
        let bad = |m: String| Err(VizError::Input(format!("`{}`: {m}", self.title)));
        if self.rows.checked_mul(self.keys) != Some(self.probs.len()) {
            return bad(format!(
                "{} probabilities for {} x {}",
                self.probs.len(),
                self.rows,
                self.keys
            ));
        }
        if !self.hidden.is_empty() && self.hidden.len() != self.probs.len() {
            return bad(format!(
                "{} hidden flags for {}",
                self.hidden.len(),
                self.probs.len()
            ));
        }
        for (what, labels, n) in [
            ("row", &self.row_labels, self.rows),
            ("key", &self.key_labels, self.keys),
        ] {
            if !labels.is_empty() && labels.len() != n {
                return bad(format!("{} {what} labels for {n} {what}s", labels.len()));
            }
        }
        Ok(())
    }

    /// Label of row `i`.
    pub fn row_label(&self, i: usize) -> String {
        self.row_labels
            .get(i)
            .cloned()
            .unwrap_or_else(|| i.to_string())
    }

    /// Label of key `j`.
    pub fn key_label(&self, j: usize) -> String {
        self.key_labels
            .get(j)
            .cloned()
            .unwrap_or_else(|| j.to_string())
    }
}
