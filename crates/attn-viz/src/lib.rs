//! # attn-viz: attention maps, drawn and exported
//!
//! attn's backends return attention maps on request
//! ([`attn_spec::AttentionMaps`], `MultiHeadAttention::forward_with_maps`):
//! `[batches, heads, rows, keys]` f32 probabilities. This crate turns them
//! into pictures and files:
//!
//! - [`HeadMap`]: one head's `rows x keys` map with token labels and the
//!   pairs the mask hides ([`HeadMap::with_problem`]: causal, windows,
//!   padding);
//! - [`render_head`]: one head as a heatmap with token labels on both
//!   axes, [`render_grid`]: a grid of layers x heads; both with a viridis
//!   colour bar (perceptually uniform, readable in grey and by colour-blind
//!   readers), hidden pairs in a light grey that no weight takes, as SVG
//!   or PNG by the file's extension (PNG text from an embedded DejaVu
//!   font: no system fonts or libraries needed);
//! - [`export`]: `.npy` files and JSON in the layout Python tools read
//!   (per layer `[batch, heads, q, k]`, as bertviz's `head_view` takes).
//!
//! ```no_run
//! use attn_viz::{render_head, HeadMap};
//! // A 3 x 3 causal map: row i attends uniformly to keys 0..=i.
//! let probs = vec![1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0];
//! let map = HeadMap::new("uniform causal", 3, 3, probs)
//!     .unwrap()
//!     .with_hidden(|i, j| j > i)
//!     .with_tokens(&["a", "b", "c"], &["a", "b", "c"]);
//! render_head(&map, "target/attn-maps/uniform.png".as_ref()).unwrap();
//! ```

mod draw;
pub mod export;
mod map;

pub use draw::{render_grid, render_head, Cells, GridLayout, HeadLayout, HIDDEN_RGB};
pub use map::HeadMap;

use std::fmt;

/// What went wrong drawing or writing a map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VizError {
    /// The data does not describe a map (sizes, labels).
    Input(String),
    /// The drawing backend or the file system failed.
    Output(String),
}

impl fmt::Display for VizError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VizError::Input(m) => write!(f, "attention map: {m}"),
            VizError::Output(m) => write!(f, "drawing an attention map: {m}"),
        }
    }
}

impl std::error::Error for VizError {}
