//! The renderer's output, checked: picture sizes, pixels at known cells
//! (hidden pairs grey, the largest weight viridis' top, small weights
//! its bottom), labels and one panel per head in the SVG text, and typed
//! errors for bad input.

use attn_viz::{render_grid, render_head, HeadMap, VizError, HIDDEN_RGB};
use plotters::prelude::{ColorMap, ViridisRGB};
use std::path::PathBuf;

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("attn-viz-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rgb_at(img: &image::RgbImage, (x, y): (i32, i32)) -> (u8, u8, u8) {
    let p = img.get_pixel(x as u32, y as u32);
    (p[0], p[1], p[2])
}

/// The text of every `<text>` element of an SVG file.
fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let body = &t[t.find('>')? + 1..];
            Some(body[..body.find("</text>")?].trim().to_string())
        })
        .collect()
}

fn viridis(t: f32) -> (u8, u8, u8) {
    let c = ViridisRGB.get_color(t);
    (c.0, c.1, c.2)
}

/// A causal 6 x 6 map, uniform over the visible keys, token labels.
fn causal() -> HeadMap {
    let n = 6;
    let probs = (0..n)
        .flat_map(|i| (0..n).map(move |j| if j <= i { 1.0 / (i + 1) as f32 } else { 0.0 }))
        .collect();
    let toks = ["the", "cat", "sat", "on", "a", "mat"];
    HeadMap::new("layer 0, head 1", n, n, probs)
        .unwrap()
        .with_hidden(|i, j| j > i)
        .with_tokens(&toks, &toks)
}

#[test]
fn one_head_png_and_svg() {
    let map = causal();
    let png = dir().join("head.png");
    let l = render_head(&map, &png).unwrap();
    let img = image::open(&png).unwrap().to_rgb8();
    assert_eq!(img.dimensions(), l.size);
    // Hidden pairs grey; row 0 key 0 (weight 1, the largest) viridis' top;
    // row 5 (weight 1/6 each) a sixth of the way up.
    assert_eq!(rgb_at(&img, l.cells.centre(0, 5)), HIDDEN_RGB);
    assert_eq!(rgb_at(&img, l.cells.centre(2, 3)), HIDDEN_RGB);
    assert_eq!(rgb_at(&img, l.cells.centre(0, 0)), viridis(1.0));
    assert_eq!(rgb_at(&img, l.cells.centre(5, 2)), viridis(1.0 / 6.0));
    // Labels are drawn: the column left of the cells holds dark pixels.
    let dark = (0..l.cells.x0 - 2)
        .flat_map(|x| (l.cells.y0..l.cells.y0 + 6 * l.cells.cell).map(move |y| (x, y)))
        .filter(|&p| rgb_at(&img, p).0 < 100)
        .count();
    assert!(dark > 50, "no row labels drawn ({dark} dark pixels)");

    let svg = dir().join("head.svg");
    let ls = render_head(&map, &svg).unwrap();
    assert_eq!(ls, l);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains(&format!("width=\"{}\"", l.size.0)));
    let texts = svg_texts(&text);
    let count = |s: &str| texts.iter().filter(|t| *t == s).count();
    for tok in ["the", "cat", "sat", "on", "a", "mat"] {
        // Each token labels a row and a key.
        assert_eq!(count(tok), 2, "token {tok} in {texts:?}");
    }
    for s in [
        "layer 0, head 1",
        "weight",
        "masked",
        "1.00",
        "0.50",
        "0.00",
        "keys",
        "queries",
    ] {
        assert_eq!(count(s), 1, "{s} in {texts:?}");
    }
    // 15 hidden cells and the legend's swatch.
    let grey = format!(
        "fill=\"#{:02X}{:02X}{:02X}\"",
        HIDDEN_RGB.0, HIDDEN_RGB.1, HIDDEN_RGB.2
    );
    assert_eq!(text.matches(&grey).count(), 16, "{grey}");
}

/// Two layers x three heads: one panel per head, each where the layout
/// says (panel (l, h) puts all weight on key l + h), head and layer titles.
#[test]
fn a_grid_of_layers_by_heads() {
    let n = 5;
    let grid: Vec<Vec<HeadMap>> = (0..2)
        .map(|l| {
            (0..3)
                .map(|h| {
                    let t = l + h;
                    let probs = (0..n * n)
                        .map(|e| if e % n == t { 1.0 } else { 0.0 })
                        .collect();
                    HeadMap::new(format!("{l}.{h}"), n, n, probs).unwrap()
                })
                .collect()
        })
        .collect();
    let png = dir().join("grid.png");
    let l = render_grid(&grid, "a model", &png).unwrap();
    assert_eq!(l.panels.len(), 2);
    assert!(l.panels.iter().all(|r| r.len() == 3));
    let img = image::open(&png).unwrap().to_rgb8();
    assert_eq!(img.dimensions(), l.size);
    for (li, row) in l.panels.iter().enumerate() {
        for (hi, at) in row.iter().enumerate() {
            for i in 0..n {
                for j in 0..n {
                    let want = if j == li + hi {
                        viridis(1.0)
                    } else {
                        viridis(0.0)
                    };
                    assert_eq!(
                        rgb_at(&img, at.centre(i, j)),
                        want,
                        "panel {li},{hi} cell {i},{j}"
                    );
                }
            }
        }
    }
    let svg = dir().join("grid.svg");
    render_grid(&grid, "a model", &svg).unwrap();
    let texts = svg_texts(&std::fs::read_to_string(&svg).unwrap());
    for s in [
        "head 0", "head 1", "head 2", "layer 0", "layer 1", "a model",
    ] {
        assert_eq!(
            texts.iter().filter(|t| *t == s).count(),
            1,
            "{s} in {texts:?}"
        );
    }
    // Title, 3 head and 2 layer titles, the legend's 5 texts: nothing else.
    assert_eq!(texts.len(), 11, "{texts:?}");
}

#[test]
fn bad_input_is_a_typed_error() {
    let map = causal();
    let e = render_head(&map, &dir().join("head.jpg")).unwrap_err();
    assert!(
        matches!(e, VizError::Input(ref m) if m.contains(".svg or .png")),
        "{e}"
    );
    let bad = map.clone().with_tokens(&["a"], &["b"]);
    let e = render_head(&bad, &dir().join("bad.png")).unwrap_err();
    assert!(
        matches!(e, VizError::Input(ref m) if m.contains("1 row labels for 6 rows")),
        "{e}"
    );
    assert!(HeadMap::new("x", 2, 3, vec![0.0; 5]).is_err());
    assert!(render_grid(&[vec![]], "empty", &dir().join("g.png")).is_err());
}
