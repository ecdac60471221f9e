//! The cost-curve plot (`bench-curves.svg` beside BENCHMARKS.md): time vs files in the tree,
//! log-log, one line per operation of `bench_curves.rs` (medians; rows without one, over budget
//! or skipped, are left out). Drawn with plotters' SVG backend, no font files needed (the SVG
//! names a font family; the viewer lays the text out).

use std::path::Path;

use anyhow::{Result, anyhow, bail};
use plotters::prelude::*;

use crate::bench_curves::{Curves, OPS};

/// One colour per operation of [`OPS`], in order (rsync black: the baseline).
const COLOURS: [RGBColor; 7] = [
    RGBColor(0, 0, 0),
    RGBColor(31, 119, 180),
    RGBColor(148, 103, 189),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(214, 39, 40),
    RGBColor(140, 86, 75),
];

/// One operation's line: its name, its index in [`OPS`] (its colour) and (files, seconds).
pub type Series = (&'static str, usize, Vec<(f64, f64)>);

/// The measured points of each operation.
pub fn series(c: &Curves) -> Vec<Series> {
    OPS.iter()
        .enumerate()
        .map(|(op, (name, _))| {
            let pts = c
                .sizes
                .iter()
                .filter_map(|s| {
                    s.rows[op]
                        .median()
                        .map(|d| (s.files as f64, d.as_secs_f64().max(1e-6)))
                })
                .collect::<Vec<_>>();
            (*name, op, pts)
        })
        // The daemon's own figure of the first sync lies on the API call's line: table only.
        .filter(|(_, op, pts)| *op != crate::bench_curves::FIRST_DAEMON && !pts.is_empty())
        .collect()
}

/// A time axis label: "20 ms", "1.5 s", "60 s".
fn axis_label(secs: f64) -> String {
    match secs {
        s if s < 0.01 => format!("{:.1} ms", s * 1000.0),
        s if s < 1.0 => format!("{:.0} ms", s * 1000.0),
        s if s < 10.0 => format!("{s:.1} s"),
        s => format!("{s:.0} s"),
    }
}

/// Writes the plot to `path`.
pub fn write_svg(c: &Curves, path: &Path) -> Result<()> {
    let series = series(c);
    let all = || series.iter().flat_map(|(_, _, p)| p.iter().copied());
    let Some(x_min) = all().map(|p| p.0).reduce(f64::min) else {
        bail!("no measured row to plot");
    };
    let x_max = all().map(|p| p.0).fold(x_min, f64::max);
    let y_min = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y_max = all().map(|p| p.1).fold(0.0, f64::max);
    let e = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());

    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Workspace cost curves: time vs files (log-log, {})",
                c.accel
            ),
            ("sans-serif", 26),
        )
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (x_min / 1.5..x_max * 1.5).log_scale(),
            (y_min / 2.0..y_max * 2.0).log_scale(),
        )
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .label_style(("sans-serif", 18))
        .axis_desc_style(("sans-serif", 20))
        .x_desc("files in the tree (10 KiB each)")
        .y_desc("time (median)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| axis_label(*y))
        .draw()
        .map_err(|x| e(&x))?;
    for (name, op, pts) in &series {
        let colour = COLOURS[*op % COLOURS.len()];
        let style = ShapeStyle {
            color: colour.to_rgba(),
            filled: false,
            stroke_width: if *op == 0 { 3 } else { 2 },
        };
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), style))
            .map_err(|x| e(&x))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        chart
            .draw_series(
                pts.iter()
                    .map(|&p| Circle::new(p, 4, ShapeStyle::from(&colour).filled())),
            )
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 18))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
