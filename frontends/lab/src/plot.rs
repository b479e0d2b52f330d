//! SVG plots of a lab table with plotters (SVG backend, default features
//! off, so no font files are needed: text is emitted as SVG `<text>`).
//!
//! x values are treated as categories in row order (delays, depths, path
//! names), which suits every experiment's table; series are columns.

use crate::report::{LabReport, PlotKind, PlotSpec};
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn num(v: Option<&Value>) -> Option<f64> {
    v.and_then(|v| v.as_f64())
}

/// Draw `report` per its plot spec into `path`.
pub fn write_svg(report: &LabReport, spec: &PlotSpec, path: &Path) -> Result<()> {
    let rows: Vec<_> = report
        .rows
        .iter()
        .filter(|r| spec.filter.iter().all(|(k, v)| r.get(k) == Some(v)))
        .collect();
    if rows.is_empty() {
        return Err(anyhow!("plot of {}: no rows to draw", report.experiment));
    }
    let labels: Vec<String> = rows
        .iter()
        .map(|r| crate::report::fmt_value(r.get(&spec.x)))
        .collect();
    let n = labels.len();
    let mut ymax = 0f64;
    for r in &rows {
        for s in &spec.series {
            if let Some(v) = num(r.get(s)) {
                ymax = ymax.max(v);
            }
        }
    }
    let ymax = if ymax <= 0.0 { 1.0 } else { ymax * 1.1 };

    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("svg: {e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{}: {}", report.experiment, report.title),
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax)
        .map_err(|e| anyhow!("svg: {e}"))?;
    let labels_for_axis = labels.clone();
    chart
        .configure_mesh()
        .x_desc(&spec.x_label)
        .y_desc(&spec.y_label)
        .x_labels(n.min(24))
        .x_label_formatter(&move |x: &f64| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 && (i as usize) < labels_for_axis.len() {
                labels_for_axis[i as usize].clone()
            } else {
                String::new()
            }
        })
        .draw()
        .map_err(|e| anyhow!("svg: {e}"))?;

    let k = spec.series.len().max(1) as f64;
    for (si, s) in spec.series.iter().enumerate() {
        let color = PALETTE[si % PALETTE.len()];
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| num(r.get(s)).map(|v| (i as f64, v)))
            .collect();
        match spec.kind {
            PlotKind::Line => {
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(|e| anyhow!("svg: {e}"))?
                    .label(s.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(
                        pts.iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                    )
                    .map_err(|e| anyhow!("svg: {e}"))?;
            }
            PlotKind::Bar => {
                let w = 0.8 / k;
                chart
                    .draw_series(pts.iter().map(|&(x, y)| {
                        let x0 = x - 0.4 + w * si as f64;
                        Rectangle::new([(x0, 0.0), (x0 + w * 0.95, y)], color.filled())
                    }))
                    .map_err(|e| anyhow!("svg: {e}"))?
                    .label(s.clone())
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                    });
            }
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| anyhow!("svg: {e}"))?;
    root.present().map_err(|e| anyhow!("svg: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn writes_line_and_bar_svgs_with_series_names() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = LabReport::new("demo", "a demo", &["depth", "old", "new"]);
        for (d, o, n) in [(2, 10.0, 12.0), (4, 20.0, 25.0), (8, 30.0, 31.0)] {
            r.push_row([("depth", json!(d)), ("old", json!(o)), ("new", json!(n))]);
        }
        for kind in [PlotKind::Line, PlotKind::Bar] {
            let spec = PlotSpec {
                x: "depth".into(),
                series: vec!["old".into(), "new".into()],
                x_label: "hw queue depth".into(),
                y_label: "IOPS".into(),
                kind,
                filter: vec![],
            };
            let p = dir.path().join(format!("{kind:?}.svg"));
            write_svg(&r, &spec, &p).unwrap();
            let svg = std::fs::read_to_string(&p).unwrap();
            assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
            let texts: Vec<&str> = svg.lines().map(str::trim).collect();
            assert!(
                texts.contains(&"old") && texts.contains(&"new"),
                "legend missing"
            );
            assert!(texts.contains(&"8"), "x category label missing");
            assert!(svg.contains("hw queue depth"));
        }
        let spec = PlotSpec {
            x: "depth".into(),
            series: vec!["old".into()],
            filter: vec![("depth".into(), json!(99))],
            ..Default::default()
        };
        assert!(write_svg(&r, &spec, &dir.path().join("none.svg")).is_err());
    }
}
