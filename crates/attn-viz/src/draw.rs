//! Heatmaps of attention maps with plotters, on the SVG or the bitmap
//! backend (chosen by the file's extension), laid out by hand: a cell per
//! (row, key), labels, a colour bar and a swatch for hidden pairs.
//!
//! Colours: viridis from 0 to the largest weight drawn (perceptually
//! uniform, so equal steps of weight look like equal steps of colour),
//! hidden pairs [`HIDDEN_RGB`] (a light grey, lighter than viridis' dark
//! end and less saturated than its light end, so no weight is drawn in
//! it), a NaN weight red.

use crate::{HeadMap, VizError};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontTransform;
use std::path::Path;
use std::sync::OnceLock;

/// The colour of hidden (masked, padded) pairs.
pub const HIDDEN_RGB: (u8, u8, u8) = (0xD0, 0xD0, 0xD0);

const FONT: &str = "sans-serif";

/// Registers the embedded DejaVu Sans for the bitmap backend (the SVG
/// backend writes text as text and only measures it).
fn fonts() -> Result<(), VizError> {
    static LOADED: OnceLock<bool> = OnceLock::new();
    let ok = *LOADED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
            && plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(VizError::Output("the embedded font did not load".into()))
    }
}

fn colour(p: f32, vmax: f32) -> RGBColor {
    if p.is_nan() {
        return RED;
    }
    let t = if vmax > 0.0 {
        (p / vmax).clamp(0.0, 1.0)
    } else {
        0.0
    };
    ViridisRGB.get_color(t)
}

fn hidden() -> RGBColor {
    RGBColor(HIDDEN_RGB.0, HIDDEN_RGB.1, HIDDEN_RGB.2)
}

fn out_err<E: std::fmt::Debug>(e: E) -> VizError {
    VizError::Output(format!("{e:?}"))
}

/// Width in pixels of `s` at font size `fs` (DejaVu Sans averages about
/// 0.6 em per character).
fn text_w(s: &str, fs: i32) -> i32 {
    (s.chars().count() as f64 * f64::from(fs) * 0.62).ceil() as i32
}

/// Where a heatmap's cells go: cell `(i, j)` covers `x0 + j * cell .. +
/// cell`, `y0 + i * cell .. + cell`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cells {
    /// Left edge of the cells.
    pub x0: i32,
    /// Top edge.
    pub y0: i32,
    /// Side of a cell in pixels.
    pub cell: i32,
}

impl Cells {
    /// The centre of cell `(i, j)`.
    pub fn centre(&self, i: usize, j: usize) -> (i32, i32) {
        (
            self.x0 + j as i32 * self.cell + self.cell / 2,
            self.y0 + i as i32 * self.cell + self.cell / 2,
        )
    }
}

/// Draws `map`'s cells (and, when `labels`, its row and key labels at font
/// size `fs`, every `step`-th).
fn cells<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    map: &HeadMap,
    at: Cells,
    vmax: f32,
    labels: Option<(i32, usize)>,
) -> Result<(), VizError> {
    let c = at.cell;
    for i in 0..map.rows {
        for j in 0..map.keys {
            let col = if map.is_hidden(i, j) {
                hidden()
            } else {
                colour(map.probs[i * map.keys + j], vmax)
            };
            let (x, y) = (at.x0 + j as i32 * c, at.y0 + i as i32 * c);
            area.draw(&Rectangle::new([(x, y), (x + c, y + c)], col.filled()))
                .map_err(out_err)?;
        }
    }
    let Some((fs, step)) = labels else {
        return Ok(());
    };
    let style = (FONT, fs).into_font().color(&BLACK);
    for i in (0..map.rows).step_by(step) {
        let (_, y) = at.centre(i, 0);
        let t = style.pos(Pos::new(HPos::Right, VPos::Center));
        area.draw(&Text::new(map.row_label(i), (at.x0 - 4, y), t))
            .map_err(out_err)?;
    }
    let below = at.y0 + map.rows as i32 * c + 4;
    for j in (0..map.keys).step_by(step) {
        let (x, _) = at.centre(0, j);
        let t = (FONT, fs)
            .into_font()
            .transform(FontTransform::Rotate90)
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Center));
        area.draw(&Text::new(map.key_label(j), (x - 2, below), t))
            .map_err(out_err)?;
    }
    Ok(())
}

/// A vertical colour bar from 0 (bottom) to `vmax` (top) at `(x, y)`,
/// `h` pixels tall, with three tick labels and a swatch for hidden pairs
/// below it.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    (x, y, h): (i32, i32, i32),
    vmax: f32,
) -> Result<(), VizError> {
    let w = 14;
    let steps = h.max(1);
    for s in 0..steps {
        let t = 1.0 - s as f32 / (steps - 1).max(1) as f32;
        let yy = y + s;
        area.draw(&Rectangle::new(
            [(x, yy), (x + w, yy + 1)],
            colour(t * vmax, vmax).filled(),
        ))
        .map_err(out_err)?;
    }
    area.draw(&Rectangle::new(
        [(x, y), (x + w, y + h)],
        BLACK.stroke_width(1),
    ))
    .map_err(out_err)?;
    let fs = 11;
    let style = (FONT, fs).into_font().color(&BLACK);
    let title = style.pos(Pos::new(HPos::Left, VPos::Bottom));
    area.draw(&Text::new("weight", (x, y - 6), title))
        .map_err(out_err)?;
    for (frac, v) in [(0.0, vmax), (0.5, vmax / 2.0), (1.0, 0.0)] {
        let yy = y + (frac * f64::from(h)) as i32;
        area.draw(&PathElement::new(vec![(x + w, yy), (x + w + 4, yy)], BLACK))
            .map_err(out_err)?;
        let t = style.pos(Pos::new(HPos::Left, VPos::Center));
        area.draw(&Text::new(format!("{v:.2}"), (x + w + 6, yy), t))
            .map_err(out_err)?;
    }
    let sy = y + h + 14;
    area.draw(&Rectangle::new(
        [(x, sy), (x + w, sy + w)],
        hidden().filled(),
    ))
    .map_err(out_err)?;
    let t = style.pos(Pos::new(HPos::Left, VPos::Center));
    area.draw(&Text::new("masked", (x + w + 6, sy + w / 2), t))
        .map_err(out_err)?;
    Ok(())
}

/// Width the legend takes.
const LEGEND_W: i32 = 90;

/// The picture of one head: its size and where its cells are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadLayout {
    /// Width and height of the picture.
    pub size: (u32, u32),
    /// The cells.
    pub cells: Cells,
    font: i32,
    step: usize,
}

impl HeadLayout {
    /// The layout [`render_head`] uses for `map`: cells of 3 to 32 pixels
    /// (about 480 pixels for the longer side), labels of 9 to 13 pixels,
    /// every label when they fit, else every n-th.
    pub fn of(map: &HeadMap) -> HeadLayout {
        let n = map.rows.max(map.keys).max(1) as i32;
        let cell = (480 / n).clamp(3, 32);
        let font = (cell * 4 / 5).clamp(9, 13);
        let step = ((font * 13 / 10) as f64 / f64::from(cell)).ceil().max(1.0) as usize;
        let widest = |f: &dyn Fn(usize) -> String, n: usize| {
            (0..n).map(|i| text_w(&f(i), font)).max().unwrap_or(0)
        };
        let row_w = widest(&|i| map.row_label(i), map.rows);
        let key_w = widest(&|j| map.key_label(j), map.keys);
        let (x0, y0) = (row_w + 30, 44);
        let (gw, gh) = (cell * map.keys as i32, cell * map.rows as i32);
        let width = x0 + gw + 24 + LEGEND_W;
        let height = y0 + gh.max(150) + key_w + 34;
        HeadLayout {
            size: (width as u32, height as u32),
            cells: Cells { x0, y0, cell },
            font,
            step,
        }
    }
}

fn draw_head<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    map: &HeadMap,
    l: &HeadLayout,
) -> Result<(), VizError> {
    root.fill(&WHITE).map_err(out_err)?;
    let vmax = map.max_weight();
    let title = (FONT, 16, FontStyle::Bold).into_font().color(&BLACK);
    root.draw(&Text::new(map.title.clone(), (10, 10), title))
        .map_err(out_err)?;
    cells(root, map, l.cells, vmax, Some((l.font, l.step)))?;
    let c = l.cells;
    let gw = c.cell * map.keys as i32;
    let gh = c.cell * map.rows as i32;
    let axis = (FONT, 12).into_font().color(&BLACK);
    let (w, h) = (l.size.0 as i32, l.size.1 as i32);
    root.draw(&Text::new(
        "keys",
        (c.x0 + gw / 2, h - 8),
        axis.pos(Pos::new(HPos::Center, VPos::Bottom)),
    ))
    .map_err(out_err)?;
    let side = (FONT, 12)
        .into_font()
        .transform(FontTransform::Rotate270)
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Center));
    root.draw(&Text::new("queries", (8, c.y0 + gh / 2), side))
        .map_err(out_err)?;
    legend(root, (w - LEGEND_W, c.y0 + 16, gh.max(150) - 60), vmax)
}

enum Kind {
    Svg,
    Png,
}

fn kind(path: &Path) -> Result<Kind, VizError> {
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => Ok(Kind::Svg),
        Some(e) if e.eq_ignore_ascii_case("png") => Ok(Kind::Png),
        _ => Err(VizError::Input(format!(
            "{}: the file name must end in .svg or .png",
            path.display()
        ))),
    }
}

fn parent_dir(path: &Path) -> Result<(), VizError> {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => std::fs::create_dir_all(d)
            .map_err(|e| VizError::Output(format!("{}: {e}", d.display()))),
        _ => Ok(()),
    }
}

/// Draws one head as a heatmap into `path` (`.svg` or `.png`): token labels
/// on both axes (queries down the left, keys under the cells), a title, a
/// viridis colour bar from 0 to the largest weight, hidden pairs grey.
/// Returns the layout it used.
pub fn render_head(map: &HeadMap, path: &Path) -> Result<HeadLayout, VizError> {
    map.check()?;
    fonts()?;
    parent_dir(path)?;
    let l = HeadLayout::of(map);
    match kind(path)? {
        Kind::Svg => {
            let root = SVGBackend::new(path, l.size).into_drawing_area();
            draw_head(&root, map, &l)?;
            root.present().map_err(out_err)?;
        }
        Kind::Png => {
            let root = BitMapBackend::new(path, l.size).into_drawing_area();
            draw_head(&root, map, &l)?;
            root.present().map_err(out_err)?;
        }
    }
    Ok(l)
}

/// The picture of a grid of maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GridLayout {
    /// Width and height of the picture.
    pub size: (u32, u32),
    /// The cells of each panel, `[layer][head]`.
    pub panels: Vec<Vec<Cells>>,
}

impl GridLayout {
    /// The layout [`render_grid`] uses: panels of about 160 pixels (cells
    /// of 2 to 12), 16 pixels apart, head titles above the first row,
    /// layer titles left of each row.
    pub fn of(grid: &[Vec<HeadMap>]) -> GridLayout {
        let n = grid
            .iter()
            .flatten()
            .map(|m| m.rows.max(m.keys))
            .max()
            .unwrap_or(1)
            .max(1) as i32;
        let cell = (160 / n).clamp(2, 12);
        let side = cell * n;
        let heads = grid.iter().map(Vec::len).max().unwrap_or(0) as i32;
        let (x0, y0, gap) = (70, 64, 16);
        let panels = grid
            .iter()
            .enumerate()
            .map(|(l, row)| {
                (0..row.len())
                    .map(|h| Cells {
                        x0: x0 + h as i32 * (side + gap),
                        y0: y0 + l as i32 * (side + gap),
                        cell,
                    })
                    .collect()
            })
            .collect();
        let width = x0 + heads * (side + gap) + 8 + LEGEND_W;
        let height = y0 + (grid.len() as i32 * (side + gap)).max(200) + 16;
        GridLayout {
            size: (width as u32, height as u32),
            panels,
        }
    }
}

fn draw_grid<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    grid: &[Vec<HeadMap>],
    title: &str,
    l: &GridLayout,
) -> Result<(), VizError> {
    root.fill(&WHITE).map_err(out_err)?;
    let vmax = grid
        .iter()
        .flatten()
        .map(HeadMap::max_weight)
        .fold(0.0f32, f32::max);
    let bold = (FONT, 16, FontStyle::Bold).into_font().color(&BLACK);
    root.draw(&Text::new(title.to_string(), (10, 10), bold))
        .map_err(out_err)?;
    let label = (FONT, 12).into_font().color(&BLACK);
    for (li, row) in grid.iter().enumerate() {
        for (hi, map) in row.iter().enumerate() {
            let at = l.panels[li][hi];
            cells(root, map, at, vmax, None)?;
            let side = at.cell * map.rows.max(map.keys) as i32;
            if li == 0 {
                let t = label.pos(Pos::new(HPos::Center, VPos::Bottom));
                root.draw(&Text::new(
                    format!("head {hi}"),
                    (at.x0 + side / 2, at.y0 - 6),
                    t,
                ))
                .map_err(out_err)?;
            }
            if hi == 0 {
                let t = label.pos(Pos::new(HPos::Right, VPos::Center));
                root.draw(&Text::new(
                    format!("layer {li}"),
                    (at.x0 - 8, at.y0 + side / 2),
                    t,
                ))
                .map_err(out_err)?;
            }
        }
    }
    let h = (l.size.1 as i32 - 64 - 80).max(60);
    legend(root, (l.size.0 as i32 - LEGEND_W, 80, h), vmax)
}

/// Draws a grid of maps, `grid[layer][head]` (the "model view"), into
/// `path` (`.svg` or `.png`), all on one colour scale (0 to the largest
/// weight of any panel), hidden pairs grey. Returns the layout it used.
pub fn render_grid(
    grid: &[Vec<HeadMap>],
    title: &str,
    path: &Path,
) -> Result<GridLayout, VizError> {
    for m in grid.iter().flatten() {
        m.check()?;
    }
    if grid.iter().all(Vec::is_empty) {
        return Err(VizError::Input("an empty grid".into()));
    }
    fonts()?;
    parent_dir(path)?;
    let l = GridLayout::of(grid);
    match kind(path)? {
        Kind::Svg => {
            let root = SVGBackend::new(path, l.size).into_drawing_area();
            draw_grid(&root, grid, title, &l)?;
            root.present().map_err(out_err)?;
        }
        Kind::Png => {
            let root = BitMapBackend::new(path, l.size).into_drawing_area();
            draw_grid(&root, grid, title, &l)?;
            root.present().map_err(out_err)?;
        }
    }
    Ok(l)
}
