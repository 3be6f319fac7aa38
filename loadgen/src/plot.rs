//! PNG charts of a sweep: TTFT, TPOT and output throughput against concurrency or request
//! rate, one line per labelled run, so configurations compare at a glance.
//!
//! Drawn with plotters' bitmap backend and a font compiled into the binary: no system font
//! library, no fontconfig, the same pixels on every machine.

use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::SegmentValue;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::report::SummaryRow;
use super::run::{fmt_x, Axis};

/// DejaVu Sans; its license is beside it in loadgen/fonts/.
const FONT: &[u8] = include_bytes!("../fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

/// A labelled sweep: one line on each chart.
pub struct Series {
    pub label: String,
    pub rows: Vec<SummaryRow>,
}

struct Panel {
    file: &'static str,
    title: &'static str,
    y_desc: &'static str,
    mean: fn(&SummaryRow) -> f64,
    p99: Option<fn(&SummaryRow) -> f64>,
}

const PANELS: [Panel; 3] = [
    Panel {
        file: "ttft.png",
        title: "Time to first token: mean (solid), P99 (dashed)",
        y_desc: "TTFT (ms)",
        mean: |r| r.mean_ttft_ms,
        p99: Some(|r| r.p99_ttft_ms),
    },
    Panel {
        file: "tpot.png",
        title: "Time per output token: mean (solid), P99 (dashed)",
        y_desc: "TPOT (ms)",
        mean: |r| r.mean_tpot_ms,
        p99: Some(|r| r.p99_tpot_ms),
    },
    Panel {
        file: "throughput.png",
        title: "Output token throughput",
        y_desc: "output tokens/s",
        mean: |r| r.output_throughput,
        p99: None,
    },
];

/// Colors told apart easily, also in grey print.
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut ok = true;
    ONCE.call_once(|| ok = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded chart font could not be read"))
    }
}

/// Writes `ttft.png`, `tpot.png`, `throughput.png` and all three side by side in
/// `overview.png` into `dir`; returns their paths.
pub fn draw(dir: &Path, axis: Axis, series: &[Series]) -> Result<Vec<PathBuf>> {
    register_font()?;
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow!("creating the chart folder {}: {e}", dir.display()))?;
    // Settings are evenly spaced whatever their values: sweeps double (1, 2, 4, …) or end
    // at an unlimited rate, neither of which a linear axis shows well.
    let mut xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.rows.iter().map(|r| r.load.x()))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    anyhow::ensure!(!xs.is_empty(), "nothing to plot: no runs");
    let mut written = Vec::new();
    for p in &PANELS {
        let path = dir.join(p.file);
        let area = BitMapBackend::new(&path, (960, 600)).into_drawing_area();
        panel(&area, p, axis, &xs, series)
            .map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
        area.present()
            .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
        drop(area);
        written.push(path);
    }
    let path = dir.join("overview.png");
    let area = BitMapBackend::new(&path, (2100, 600)).into_drawing_area();
    for (sub, p) in area.split_evenly((1, 3)).iter().zip(&PANELS) {
        panel(sub, p, axis, &xs, series).map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
    }
    area.present()
        .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    drop(area);
    written.push(path);
    Ok(written)
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    p: &Panel,
    axis: Axis,
    xs: &[f64],
    series: &[Series],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE)?;
    let pos = |x: f64| xs.iter().position(|&v| v == x).unwrap_or(0) as i32;
    let ymax = series
        .iter()
        .flat_map(|s| &s.rows)
        .flat_map(|r| [Some((p.mean)(r)), p.p99.map(|f| f(r))])
        .flatten()
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let ymax = if ymax > 0.0 { ymax * 1.12 } else { 1.0 };
    // Enough decimals that small TPOTs do not all read "2".
    let digits = if ymax >= 20.0 {
        0
    } else if ymax >= 2.0 {
        1
    } else {
        2
    };
    let mut chart = ChartBuilder::on(area)
        .caption(p.title, (FAMILY, 22))
        .margin(16)
        .x_label_area_size(52)
        .y_label_area_size(72)
        .build_cartesian_2d((0..xs.len() as i32 - 1).into_segmented(), 0f64..ymax)?;
    chart
        .configure_mesh()
        .x_labels(xs.len())
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                xs.get(*i as usize).map(|&x| fmt_x(x)).unwrap_or_default()
            }
            SegmentValue::Last => String::new(),
        })
        .y_label_formatter(&|v| format!("{v:.digits$}"))
        .x_desc(axis.title())
        .y_desc(p.y_desc)
        .label_style((FAMILY, 16))
        .axis_desc_style((FAMILY, 18))
        .bold_line_style(RGBColor(225, 225, 225))
        .light_line_style(TRANSPARENT)
        .draw()?;
    for (k, s) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let mut rows: Vec<&SummaryRow> = s.rows.iter().collect();
        rows.sort_by(|a, b| a.load.x().total_cmp(&b.load.x()));
        let at = |f: fn(&SummaryRow) -> f64| -> Vec<(SegmentValue<i32>, f64)> {
            rows.iter()
                .map(|r| (SegmentValue::CenterOf(pos(r.load.x())), f(r)))
                .collect()
        };
        let mean = at(p.mean);
        chart
            .draw_series(LineSeries::new(mean.clone(), color.stroke_width(3)))?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
            });
        chart.draw_series(
            mean.into_iter()
                .map(|pt| Circle::new(pt, 5, color.filled())),
        )?;
        if let Some(f) = p.p99 {
            chart.draw_series(DashedLineSeries::new(at(f), 8, 6, color.stroke_width(2)))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FAMILY, 16))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(190, 190, 190))
        .draw()?;
    Ok(())
}
