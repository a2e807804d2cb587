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
