//! SVG charts of a report, drawn with `plotters`: GFLOP/s per case per
//! backend at each thread count against the peak line, and time against
//! sequence length for the causal prefill family.

use crate::machine::Machine;
use crate::report::Record;
use plotters::prelude::*;
use std::path::Path;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Writes `gflops_t{threads}.svg` for every thread count and
/// `prefill_time.svg`; returns the files written.
pub fn write(dir: &Path, m: &Machine, records: &[Record]) -> Result<Vec<String>, String> {
    let mut files = Vec::new();
    let mut threads: Vec<usize> = records.iter().map(|r| r.threads).collect();
    threads.sort_unstable();
    threads.dedup();
    for t in threads {
        let name = format!("gflops_t{t}.svg");
        gflops_chart(&dir.join(&name), m, records, t)?;
        files.push(name);
    }
    if prefill_chart(&dir.join("prefill_time.svg"), records)? {
        files.push("prefill_time.svg".into());
    }
    Ok(files)
}

fn backends(records: &[Record]) -> Vec<String> {
    let mut b: Vec<String> = Vec::new();
    for r in records {
        if !b.contains(&r.backend) {
            b.push(r.backend.clone());
        }
    }
    b
}

fn gflops_chart(
    path: &Path,
    m: &Machine,
    records: &[Record],
    threads: usize,
) -> Result<(), String> {
    let rs: Vec<&Record> = records.iter().filter(|r| r.threads == threads).collect();
    let mut cases: Vec<&str> = Vec::new();
    for r in &rs {
        if !cases.contains(&r.case.name) {
            cases.push(r.case.name);
        }
    }
    let bk = backends(records);
    let peak = m.peak(threads);
    let ymax = rs.iter().map(|r| r.gflops()).fold(peak, f64::max) * 1.1;
    let height = 200 + 22 * cases.len() as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("GFLOP/s per case, {threads} thread(s); dashed: FMA peak {peak:.0}"),
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(260)
        .build_cartesian_2d(0f64..ymax, 0f64..cases.len() as f64)
        .map_err(err)?;
    let labels = cases.clone();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(cases.len() * 2 + 1)
        .y_label_formatter(&|y| {
            let i = y.floor() as usize;
            if (y - y.floor() - 0.5).abs() < 0.01 && i < labels.len() {
                labels[i].to_string()
            } else {
                String::new()
            }
        })
        .x_desc("GFLOP/s (visible pairs)")
        .draw()
        .map_err(err)?;
    let bar = 0.8 / bk.len().max(1) as f64;
    for (bi, b) in bk.iter().enumerate() {
        let color = COLORS[bi % COLORS.len()];
        let bars: Vec<Rectangle<(f64, f64)>> = rs
            .iter()
            .filter(|r| &r.backend == b)
            .filter_map(|r| {
                let ci = cases.iter().position(|c| *c == r.case.name)? as f64;
                let y0 = ci + 0.1 + bi as f64 * bar;
                Some(Rectangle::new(
                    [(0.0, y0), (r.gflops(), y0 + bar)],
                    color.filled(),
                ))
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(b.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    chart
        .draw_series(DashedLineSeries::new(
            vec![(peak, 0.0), (peak, cases.len() as f64)],
            6,
            4,
            BLACK.stroke_width(2),
        ))
        .map_err(err)?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Time against sequence length for causal prefill at head dim 128, f32.
fn prefill_chart(path: &Path, records: &[Record]) -> Result<bool, String> {
    let rs: Vec<&Record> = records
        .iter()
        .filter(|r| {
            r.case.name.starts_with("prefill/")
                && r.case.head_dim == 128
                && r.case.mask == attn_spec::MaskKind::Causal
                && r.case.dtype == attn_spec::DType::F32
        })
        .collect();
    let mut series: Vec<(String, usize)> = Vec::new();
    for r in &rs {
        let key = (r.backend.clone(), r.threads);
        if !series.contains(&key) {
            series.push(key);
        }
    }
    if rs.len() < 2 {
        return Ok(false);
    }
    let smax = rs.iter().map(|r| r.case.q_len).max().unwrap_or(1) as f64;
    let tmax = rs.iter().map(|r| r.median * 1e3).fold(0.0, f64::max);
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "causal prefill, head dim 128, f32: time vs sequence length",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (256f64..smax * 1.2).log_scale(),
            (0.01f64..tmax * 2.0).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("sequence length")
        .y_desc("milliseconds")
        .draw()
        .map_err(err)?;
    for (si, (b, t)) in series.iter().enumerate() {
        let color = COLORS[si % COLORS.len()];
        let mut pts: Vec<(f64, f64)> = rs
            .iter()
            .filter(|r| &r.backend == b && r.threads == *t)
            .map(|r| (r.case.q_len as f64, r.median * 1e3))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(format!("{b} t{t}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(true)
}
