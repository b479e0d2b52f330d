//! SVG figures of a lab table with plotters (SVG backend, default features
//! off, so no font files are needed: text is emitted as SVG `<text>`).
//!
//! A [`Figure`] is a grid of [`Panel`]s drawn into one SVG. Each panel
//! takes the rows that pass its filter, uses one column's values as x
//! categories in row order (delays, depths, path names, workloads) and
//! draws one [`Series`] per derived value: our figures as solid lines or
//! bars, the upstream patch's published figures as dashed lines with
//! hollow markers, so "ours" and "upstream" can be told apart at a glance.
//! What each experiment draws lives in `figures`.

use crate::report::Row;
use anyhow::{anyhow, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

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

/// A value derived from one table row (`None`: no point there).
pub type ValueFn = Box<dyn Fn(&Row) -> Option<f64>>;

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// Ours: solid line with filled dots (or a filled bar).
    Ours,
    /// Upstream's published figure: dashed line with hollow markers (or a
    /// hollow bar).
    Upstream,
}

pub struct Series {
    pub label: String,
    pub style: Style,
    /// Palette slot; an upstream series uses its counterpart's colour.
    pub color: usize,
    /// Only rows where every column equals the value (besides the
    /// panel's own filter).
    pub filter: Vec<(String, Value)>,
    pub value: ValueFn,
}

impl Series {
    pub fn new(label: &str, style: Style, color: usize, value: ValueFn) -> Series {
        Series {
            label: label.to_string(),
            style,
            color,
            filter: Vec::new(),
            value,
        }
    }

    /// The series drawn from one column's number.
    pub fn column(label: &str, style: Style, color: usize, column: &str) -> Series {
        let c = column.to_string();
        Series::new(label, style, color, Box::new(move |r| num(r, &c)))
    }

    pub fn only(mut self, column: &str, value: Value) -> Series {
        self.filter.push((column.to_string(), value));
        self
    }
}

pub struct Panel {
    pub title: String,
    /// Column whose values are the x categories.
    pub x: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    pub filter: Vec<(String, Value)>,
    /// Grouped bars instead of lines.
    pub bars: bool,
    /// A logarithmic y axis (for values spanning decades).
    pub log_y: bool,
    /// A horizontal reference line (e.g. 100 %), drawn dotted.
    pub reference: Option<f64>,
    /// Rows the panel leaves out (e.g. the 0 ms pass-through row).
    pub skip: Option<fn(&Row) -> bool>,
}

impl Panel {
    pub fn new(title: &str, x: &str, x_label: &str, y_label: &str) -> Panel {
        Panel {
            title: title.to_string(),
            x: x.to_string(),
            x_label: x_label.to_string(),
            y_label: y_label.to_string(),
            series: Vec::new(),
            filter: Vec::new(),
            bars: false,
            log_y: false,
            reference: None,
            skip: None,
        }
    }
}

pub struct Figure {
    /// File stem suffix: `NAME.svg` for "", `NAME-SUFFIX.svg` otherwise.
    pub suffix: String,
    pub title: String,
    pub columns: usize,
    pub panels: Vec<Panel>,
}

/// A row's column as a number.
pub fn num(r: &Row, column: &str) -> Option<f64> {
    r.get(column).and_then(Value::as_f64)
}

/// A row's x category as it is labelled: numbers without padding zeros.
fn category(r: &Row, x: &str) -> String {
    match r.get(x) {
        Some(Value::Number(n)) => n
            .as_f64()
            .map_or_else(|| n.to_string(), crate::report::fmt_num),
        v => crate::report::fmt_value(v),
    }
}

fn matches(r: &Row, filter: &[(String, Value)]) -> bool {
    filter.iter().all(|(k, v)| r.get(k) == Some(v))
}

const PANEL_W: u32 = 560;
/// A one-column figure's panels are wider: their x labels are words.
const WIDE_W: u32 = 1000;
const PANEL_H: u32 = 380;
const TITLE_H: u32 = 36;
/// Width of the legend strip right of each panel's plot (legends never
/// sit on the data).
const LEGEND_W: u32 = 150;

/// Draw `fig` from `rows` and return the SVG text. Panels with no point
/// at all are drawn with a "no data" note rather than dropped, so a
/// missing measurement is visible.
pub fn render_svg(fig: &Figure, rows: &[Row]) -> Result<String> {
    let cols = fig.columns.clamp(1, fig.panels.len().max(1));
    let nrows = fig.panels.len().div_ceil(cols).max(1);
    let w = if cols == 1 { WIDE_W } else { PANEL_W };
    let size = (w * cols as u32, PANEL_H * nrows as u32 + TITLE_H);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).map_err(svg_err)?;
        let (top, body) = root.split_vertically(TITLE_H);
        top.draw_text(
            &fig.title,
            &("sans-serif", 17).into_font().color(&BLACK),
            (12, 10),
        )
        .map_err(svg_err)?;
        let areas = body.split_evenly((nrows, cols));
        for (panel, area) in fig.panels.iter().zip(areas.iter()) {
            draw_panel(panel, rows, area, w)?;
        }
        root.present().map_err(svg_err)?;
    }
    Ok(out)
}

fn svg_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("svg: {e}")
}

/// One series' points: (category index, value).
fn points(s: &Series, rows: &[&Row], cats: &[String], x: &str) -> Vec<(usize, f64)> {
    rows.iter()
        .filter(|r| matches(r, &s.filter))
        .filter_map(|r| {
            let label = category(r, x);
            let i = cats.iter().position(|c| *c == label)?;
            let v = (s.value)(r)?;
            v.is_finite().then_some((i, v))
        })
        .collect()
}

/// The y axis range (in axis units, so decades on a log axis): every
/// point and the reference line, from zero on a linear axis, with room
/// above the highest point.
fn y_range(
    series: &[(&Series, Vec<(usize, f64)>)],
    p: &Panel,
    tf: &dyn Fn(f64) -> f64,
) -> (f64, f64) {
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for v in series
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|&(_, v)| tf(v)))
        .chain(p.reference.map(tf))
    {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    if p.log_y {
        (lo.floor(), hi.ceil().max(lo.floor() + 1.0))
    } else {
        (lo.min(0.0), if hi <= 0.0 { 1.0 } else { hi * 1.15 })
    }
}

fn draw_panel(
    p: &Panel,
    rows: &[Row],
    area: &DrawingArea<SVGBackend, Shift>,
    width: u32,
) -> Result<()> {
    let rows: Vec<&Row> = rows
        .iter()
        .filter(|r| matches(r, &p.filter) && !p.skip.is_some_and(|skip| skip(r)))
        .collect();
    let mut cats: Vec<String> = Vec::new();
    for r in &rows {
        let c = category(r, &p.x);
        if !cats.contains(&c) {
            cats.push(c);
        }
    }
    let series: Vec<(&Series, Vec<(usize, f64)>)> = p
        .series
        .iter()
        .map(|s| (s, points(s, &rows, &cats, &p.x)))
        .filter(|(_, pts)| !pts.is_empty())
        .collect();
    let tf = |v: f64| if p.log_y { v.max(1e-9).log10() } else { v };
    let (y0, y1) = y_range(&series, p, &tf);
    let n = cats.len().max(1);
    let (plot_area, legend_area) = area.split_horizontally(width.saturating_sub(LEGEND_W));
    draw_legend(&legend_area, &series, p.bars)?;
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(&p.title, ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), y0..y1)
        .map_err(svg_err)?;
    let cat_labels = cats.clone();
    let log_y = p.log_y;
    let y_fmt = move |y: &f64| {
        if log_y {
            crate::report::fmt_num(10f64.powf(*y))
        } else {
            crate::report::fmt_num(*y)
        }
    };
    // Long category names get a smaller font so neighbours do not overlap.
    let longest = cats.iter().map(|c| c.len()).max().unwrap_or(1);
    let per_cat = (width.saturating_sub(LEGEND_W) as usize).saturating_sub(90) / n;
    let font = if longest * 7 <= per_cat { 12 } else { 10 };
    chart
        .configure_mesh()
        .x_desc(&p.x_label)
        .y_desc(&p.y_label)
        .x_labels(n + 1)
        .y_labels(if log_y { (y1 - y0) as usize + 1 } else { 6 })
        .x_label_style(("sans-serif", font))
        .x_label_formatter(&move |x: &f64| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 && (i as usize) < cat_labels.len() {
                cat_labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&y_fmt)
        .disable_x_mesh()
        .draw()
        .map_err(svg_err)?;
    if series.is_empty() {
        chart
            .draw_series(std::iter::once(Text::new(
                "no data in this run",
                ((n as f64 - 1.0) / 2.0 - 0.3, (y0 + y1) / 2.0),
                ("sans-serif", 14),
            )))
            .map_err(svg_err)?;
    }
    if let Some(r) = p.reference {
        let y = tf(r);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(-0.5, y), (n as f64 - 0.5, y)],
                2,
                4,
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(svg_err)?;
    }
    draw_series(&mut chart, &series, p.bars, y0, &tf)?;
    Ok(())
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Every series of a panel: bars side by side per category, or lines
/// (ours solid with dots, upstream dashed with hollow triangles). `tf`
/// maps a value onto the y axis (log10 on a log axis).
fn draw_series(
    chart: &mut Chart,
    series: &[(&Series, Vec<(usize, f64)>)],
    bars: bool,
    y0: f64,
    tf: &dyn Fn(f64) -> f64,
) -> Result<()> {
    let k = series.len().max(1) as f64;
    for (si, (s, pts)) in series.iter().enumerate() {
        let color = PALETTE[s.color % PALETTE.len()];
        let pts: Vec<(f64, f64)> = pts.iter().map(|&(i, v)| (i as f64, tf(v))).collect();
        if bars {
            let w = 0.8 / k;
            let style = match s.style {
                Style::Ours => color.filled(),
                Style::Upstream => color.stroke_width(2),
            };
            chart
                .draw_series(pts.iter().map(|&(x, y)| {
                    let x0 = x - 0.4 + w * si as f64;
                    Rectangle::new([(x0, y0.max(0.0).min(y)), (x0 + w * 0.9, y)], style)
                }))
                .map_err(svg_err)?;
            continue;
        }
        match s.style {
            Style::Ours => {
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(svg_err)?;
                chart
                    .draw_series(pts.iter().map(|&pt| Circle::new(pt, 3, color.filled())))
                    .map_err(svg_err)?;
            }
            Style::Upstream => {
                chart
                    .draw_series(DashedLineSeries::new(
                        pts.clone(),
                        6,
                        4,
                        color.stroke_width(1),
                    ))
                    .map_err(svg_err)?;
                chart
                    .draw_series(
                        pts.iter()
                            .map(|&pt| TriangleMarker::new(pt, 5, color.stroke_width(2))),
                    )
                    .map_err(svg_err)?;
            }
        }
    }
    Ok(())
}

/// The legend in its own strip: a swatch per series in its style (solid
/// line and dot, dashed line and hollow triangle, filled or hollow bar).
fn draw_legend(
    area: &DrawingArea<SVGBackend, Shift>,
    series: &[(&Series, Vec<(usize, f64)>)],
    bars: bool,
) -> Result<()> {
    let font = ("sans-serif", 11).into_font().color(&BLACK);
    for (i, (s, _)) in series.iter().enumerate() {
        let y = 56 + 18 * i as i32;
        let color = PALETTE[s.color % PALETTE.len()];
        if bars {
            let style = match s.style {
                Style::Ours => color.filled(),
                Style::Upstream => color.stroke_width(2),
            };
            area.draw(&Rectangle::new([(6, y - 5), (22, y + 5)], style))
                .map_err(svg_err)?;
            area.draw(&Text::new(s.label.clone(), (30, y - 6), font.clone()))
                .map_err(svg_err)?;
            continue;
        }
        match s.style {
            Style::Ours => {
                area.draw(&PathElement::new(
                    vec![(4, y), (24, y)],
                    color.stroke_width(2),
                ))
                .map_err(svg_err)?;
                area.draw(&Circle::new((14, y), 3, color.filled()))
                    .map_err(svg_err)?;
            }
            Style::Upstream => {
                for x in [4, 12, 20] {
                    area.draw(&PathElement::new(
                        vec![(x, y), (x + 5, y)],
                        color.stroke_width(1),
                    ))
                    .map_err(svg_err)?;
                }
                area.draw(&TriangleMarker::new((14, y), 5, color.stroke_width(2)))
                    .map_err(svg_err)?;
            }
        }
        area.draw(&Text::new(s.label.clone(), (30, y - 6), font.clone()))
            .map_err(svg_err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rows() -> Vec<Row> {
        [
            (2, 10.0, 12.0, 11.0),
            (4, 20.0, 25.0, 30.0),
            (8, 30.0, 31.0, 29.0),
        ]
        .iter()
        .map(|&(d, o, n, u)| {
            let mut r = Row::new();
            r.insert("depth".into(), json!(d));
            r.insert("old".into(), json!(o));
            r.insert("new".into(), json!(n));
            r.insert("up".into(), json!(u));
            r
        })
        .collect()
    }

    #[test]
    fn draws_ours_and_upstream_series_with_legend_and_categories() {
        for bars in [false, true] {
            let mut p = Panel::new("a panel", "depth", "hw queue depth", "IOPS");
            p.bars = bars;
            p.series = vec![
                Series::column("old", Style::Ours, 0, "old"),
                Series::column("new", Style::Ours, 1, "new"),
                Series::column("upstream new", Style::Upstream, 1, "up"),
            ];
            let fig = Figure {
                suffix: String::new(),
                title: "demo figure".into(),
                columns: 1,
                panels: vec![p],
            };
            let svg = render_svg(&fig, &rows()).unwrap();
            assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
            for t in [
                "old",
                "new",
                "upstream new",
                "hw queue depth",
                "demo figure",
                ">8<",
            ] {
                assert!(
                    svg.contains(t) || svg.lines().any(|l| l.trim() == t.trim_matches(['>', '<'])),
                    "{t} missing (bars={bars})"
                );
            }
            if !bars {
                assert!(svg.contains("stroke-dasharray") || svg.matches("<line").count() > 0);
            }
        }
    }

    #[test]
    fn empty_panel_says_no_data_and_log_axis_spans_decades() {
        let mut p = Panel::new("nothing", "depth", "x", "y");
        p.series = vec![Series::column("missing", Style::Ours, 0, "absent")];
        let mut q = Panel::new("log", "depth", "x", "y");
        q.log_y = true;
        q.series = vec![Series::new(
            "x1000",
            Style::Ours,
            0,
            Box::new(|r| num(r, "old").map(|v| v * 1000.0)),
        )];
        let fig = Figure {
            suffix: String::new(),
            title: "t".into(),
            columns: 2,
            panels: vec![p, q],
        };
        let svg = render_svg(&fig, &rows()).unwrap();
        assert!(svg.contains("no data in this run"));
        // 10 000 .. 30 000 on a log axis: the 10^4 and 10^5 ticks.
        assert!(
            svg.contains("10000") || svg.contains("10k"),
            "log ticks missing"
        );
    }
}
