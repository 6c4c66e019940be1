//! Attention maps of a model trained with attn: the in-context recall
//! model of `train_recall.rs` learns its induction circuit (about 5 s),
//! then one sequence runs through it with
//! `MultiHeadAttention::forward_with_maps`, and every head is drawn:
//!
//! - `recall_grid.png` / `.svg`: layers x heads. Layer 0 learns to look
//!   one token back (each value token attends to its key: a sub-diagonal);
//!   layer 1's heads send the final query key to the value that followed
//!   the same key earlier in the sequence;
//! - `recall_head.png` / `.svg`: the layer-1 head that puts the most
//!   weight on that answer, with the tokens on both axes;
//! - `layer0.npy`, `layer1.npy` (`[1, heads, 17, 17]` f32, `numpy.load`)
//!   and `maps.json` (`{"tokens", "attention": [layer][batch][head][q][k]}`,
//!   what bertviz's `head_view` takes).
//!
//! Everything goes to `target/attn-maps/` (under `$CARGO_TARGET_DIR` when
//! set). Masked pairs (the causal mask) are grey.
//!
//! ```sh
//! cargo run --release -p attn-candle --example attention_maps [steps]
//! ```

#[path = "train_recall.rs"]
#[allow(dead_code)]
mod recall;

use attn_candle::{AttnOptions, MapRequest};
use attn_viz::export::{write_json, write_npy, LayerMaps};
use attn_viz::{render_grid, render_head, HeadMap};
use candle_core::{Device, Result, Tensor};
use recall::{HEADS, KEYS, SEQ};
use std::path::PathBuf;

fn viz(e: attn_viz::VizError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

fn main() -> Result<()> {
    let steps = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(700);
    let dir = PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
        .join("attn-maps");
    std::fs::create_dir_all(&dir)?;
    println!("training the in-context recall model for {steps} steps...");
    let (model, _) = recall::train(steps, 42, |step, loss, acc| {
        println!(
            "  step {step:4}  loss {loss:.3}  accuracy {:5.1}%",
            100.0 * acc
        )
    })?;

    // A fresh sequence (k v k v ... then a key again): of a batch, the one
    // whose asked key comes earliest, so the answer is far from the query.
    let (tokens, answers) = recall::batch(&mut recall::Rng(2026));
    let asked_at = |s: usize| {
        let seq = &tokens[s * SEQ..(s + 1) * SEQ];
        (0..SEQ - 1).step_by(2).find(|&p| seq[p] == seq[SEQ - 1])
    };
    let pick = (0..recall::BATCH)
        .min_by_key(|&s| asked_at(s).unwrap_or(SEQ))
        .expect("a batch");
    let seq: Vec<u32> = tokens[pick * SEQ..(pick + 1) * SEQ].to_vec();
    let label = |t: u32| {
        let t = t as usize;
        if t < KEYS {
            format!("k{t}")
        } else {
            format!("v{}", t - KEYS)
        }
    };
    let mut labels: Vec<String> = seq.iter().map(|&t| label(t)).collect();
    labels[SEQ - 1].push('?');
    let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
    let asked = seq[SEQ - 1];
    let key_pos = (0..SEQ - 1)
        .step_by(2)
        .find(|&p| seq[p] == asked)
        .expect("asked key");
    let answer_pos = key_pos + 1;
    println!(
        "sequence: {}  (answer: v{} at position {answer_pos})",
        labels.join(" "),
        answers[pick]
    );

    let causal = AttnOptions::default().causal();
    let mut x = model.embed(&Tensor::from_vec(seq.clone(), SEQ, &Device::Cpu)?, 1)?;
    let mut layers = Vec::new();
    for layer in &model.layers {
        let (o, maps) = layer.forward_with_maps(&x, None, &causal, &MapRequest::all())?;
        x = (o + &x)?;
        layers.push(maps.flatten_all()?.to_vec1::<f32>()?);
    }
    let grid: Vec<Vec<HeadMap>> = layers
        .iter()
        .enumerate()
        .map(|(l, m)| {
            (0..HEADS)
                .map(|h| {
                    let plane = m[h * SEQ * SEQ..(h + 1) * SEQ * SEQ].to_vec();
                    HeadMap::new(format!("layer {l}, head {h}"), SEQ, SEQ, plane)
                        .map(|hm| hm.with_hidden(|i, j| j > i).with_tokens(&labels, &labels))
                })
                .collect::<std::result::Result<Vec<_>, _>>()
        })
        .collect::<std::result::Result<_, _>>()
        .map_err(viz)?;
    let title = "in-context recall trained with attn: layers x heads";
    for ext in ["png", "svg"] {
        render_grid(&grid, title, &dir.join(format!("recall_grid.{ext}"))).map_err(viz)?;
    }
    // The layer-1 head that looks hardest at the answer from the last row.
    let last = |h: usize| grid[1][h].probs[(SEQ - 1) * SEQ + answer_pos];
    let best = (0..HEADS)
        .max_by(|&a, &b| last(a).total_cmp(&last(b)))
        .expect("heads");
    let mut head = grid[1][best].clone();
    head.title = format!(
        "layer 1, head {best}: the query {} finds {} ({:.0}% of its weight)",
        labels[SEQ - 1],
        labels[answer_pos],
        100.0 * last(best)
    );
    for ext in ["png", "svg"] {
        render_head(&head, &dir.join(format!("recall_head.{ext}"))).map_err(viz)?;
    }
    let dims = [1, HEADS, SEQ, SEQ];
    for (l, m) in layers.iter().enumerate() {
        write_npy(&dir.join(format!("layer{l}.npy")), &dims, m).map_err(viz)?;
    }
    let lm: Vec<LayerMaps<'_>> = layers.iter().map(|m| LayerMaps { dims, data: m }).collect();
    write_json(&dir.join("maps.json"), &lm, &labels).map_err(viz)?;
    println!(
        "layer 1 head {best} puts {:.1}% of the last row's weight on the answer {}",
        100.0 * last(best),
        labels[answer_pos]
    );
    println!("wrote {}/recall_grid.{{png,svg}}, recall_head.{{png,svg}}, layer0.npy, layer1.npy, maps.json", dir.display());
    Ok(())
}
