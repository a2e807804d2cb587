//! Minimal SVG line plots of singular-value spectra (log scale), one file per layer.

use std::fmt::Write;

const W: f64 = 640.0;
const H: f64 = 400.0;
const M: f64 = 50.0;
const COLORS: &[&str] =
    &["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

/// An SVG plot of `series` (one line each, y on a log10 axis, non-positive values dropped).
pub fn spectrum_svg(title: &str, y_label: &str, series: &[(String, Vec<f64>)]) -> String {
    let pos = |v: &f64| *v > 0.0 && v.is_finite();
    let ys: Vec<f64> = series.iter().flat_map(|(_, v)| v.iter().copied().filter(pos)).collect();
    let (lo, hi) = ys.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y.log10()), b.max(y.log10())));
    let (lo, hi) = if lo.is_finite() { (lo.floor(), hi.ceil().max(lo.floor() + 1.0)) } else { (-1.0, 0.0) };
    let n = series.iter().map(|(_, v)| v.len()).max().unwrap_or(1).max(2);
    let x = |i: usize| M + (W - 2.0 * M) * i as f64 / (n - 1) as f64;
    let y = |v: f64| H - M - (H - 2.0 * M) * (v.log10() - lo) / (hi - lo);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="20" text-anchor="middle" font-size="14">{title}</text>"#,
        W / 2.0
    );
    let _ = write!(
        s,
        r#"<line x1="{M}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{M}" y1="{M}" x2="{M}" y2="{}" stroke="black"/>"#,
        H - M,
        W - M,
        H - M,
        H - M
    );
    for e in lo as i64..=hi as i64 {
        let yy = y(10f64.powi(e as i32));
        let _ = write!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end">1e{e}</text><line x1="{M}" y1="{yy}" x2="{}" y2="{yy}" stroke="#ddd"/>"##,
            M - 4.0,
            yy + 4.0,
            W - M
        );
    }
    let _ = write!(s, r#"<text x="{}" y="{}" text-anchor="middle">singular value index</text>"#, W / 2.0, H - 12.0);
    let _ = write!(
        s,
        r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">{y_label}</text>"#,
        H / 2.0,
        H / 2.0
    );
    for (k, (name, v)) in series.iter().enumerate() {
        let c = COLORS[k % COLORS.len()];
        let pts: Vec<String> =
            v.iter().enumerate().filter(|(_, v)| pos(v)).map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v))).collect();
        let _ = write!(s, r#"<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{}"/>"#, pts.join(" "));
        let _ = write!(s, r#"<text x="{}" y="{}" fill="{c}">{name}</text>"#, W - M - 60.0, M + 14.0 * k as f64);
    }
    s.push_str("</svg>\n");
    s
}

/// A point series: name and (x, y) points.
pub type Series = (String, Vec<(f64, f64)>);

/// Nice tick step for a span (1, 2 or 5 times a power of ten, about five ticks).
fn tick_step(span: f64) -> f64 {
    let raw = (span / 5.0).max(f64::MIN_POSITIVE);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|s| *s >= raw).unwrap_or(10.0 * p)
}

/// An SVG plot of `series` on linear axes, one line with point markers each, and `reference`
/// (a labelled point, e.g. the unpruned model) drawn as a black diamond.
pub fn curves_svg(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    reference: Option<(&str, f64, f64)>,
) -> String {
    let ok = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let mut pts: Vec<(f64, f64)> = series.iter().flat_map(|(_, v)| v.iter().filter(ok).copied()).collect();
    pts.extend(reference.map(|(_, x, y)| (x, y)));
    let fold = |f: fn(&(f64, f64)) -> f64| {
        pts.iter().map(f).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)))
    };
    let (mut x0, mut x1) = fold(|p| p.0);
    let (mut y0, mut y1) = fold(|p| p.1);
    if !x0.is_finite() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-12 {
        (x0, x1) = (x0 - 0.5, x1 + 0.5);
    }
    if y1 - y0 < 1e-12 {
        (y0, y1) = (y0 - 0.5, y1 + 0.5);
    }
    let pad = (y1 - y0) * 0.05;
    let (y0, y1) = (y0 - pad, y1 + pad);
    let x = |v: f64| M + (W - 2.0 * M) * (v - x0) / (x1 - x0);
    let y = |v: f64| H - M - (H - 2.0 * M) * (v - y0) / (y1 - y0);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="20" text-anchor="middle" font-size="14">{title}</text>"#,
        W / 2.0
    );
    let _ = write!(
        s,
        r#"<line x1="{M}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/><line x1="{M}" y1="{M}" x2="{M}" y2="{b}" stroke="black"/>"#,
        b = H - M,
        r = W - M
    );
    let (xs, ys) = (tick_step(x1 - x0), tick_step(y1 - y0));
    let mut t = (x0 / xs).ceil() * xs;
    while t <= x1 + 1e-9 {
        let _ = write!(s, r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#, x(t), H - M + 16.0, fmt_tick(t));
        t += xs;
    }
    let mut t = (y0 / ys).ceil() * ys;
    while t <= y1 + 1e-9 {
        let yy = y(t);
        let _ = write!(
            s,
            r##"<text x="{}" y="{:.1}" text-anchor="end">{}</text><line x1="{M}" y1="{yy:.1}" x2="{}" y2="{yy:.1}" stroke="#ddd"/>"##,
            M - 4.0,
            yy + 4.0,
            fmt_tick(t),
            W - M
        );
        t += ys;
    }
    let _ = write!(s, r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text>"#, W / 2.0, H - 12.0);
    let _ = write!(
        s,
        r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">{y_label}</text>"#,
        H / 2.0,
        H / 2.0
    );
    for (k, (name, v)) in series.iter().enumerate() {
        let c = COLORS[k % COLORS.len()];
        let p: Vec<String> = v.iter().filter(ok).map(|(a, b)| format!("{:.1},{:.1}", x(*a), y(*b))).collect();
        let _ = write!(s, r#"<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{}"/>"#, p.join(" "));
        for (a, b) in v.iter().filter(ok) {
            let _ = write!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, x(*a), y(*b));
        }
        let _ = write!(s, r#"<text x="{}" y="{}" fill="{c}">{name}</text>"#, M + 10.0, M + 14.0 * k as f64);
    }
    if let Some((name, a, b)) = reference {
        let (cx, cy) = (x(a), y(b));
        let _ = write!(
            s,
            r#"<path d="M {cx:.1} {:.1} L {:.1} {cy:.1} L {cx:.1} {:.1} L {:.1} {cy:.1} Z" fill="black"/><text x="{:.1}" y="{:.1}" text-anchor="end">{name}</text>"#,
            cy - 6.0,
            cx + 6.0,
            cy + 6.0,
            cx - 6.0,
            cx - 8.0,
            cy - 8.0
        );
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_tick(v: f64) -> String {
    let r = (v * 1e6).round() / 1e6;
    format!("{r}")
}
