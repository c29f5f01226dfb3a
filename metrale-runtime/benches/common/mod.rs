//! What the benchmarks share: rows of samples, medians and ratios, and the table.

#![allow(dead_code)]

use std::time::Instant;

/// Samples of one row, one per round.
#[derive(Default, Clone)]
pub struct Row {
    pub samples: Vec<f64>,
}

impl Row {
    pub fn push(&mut self, x: f64) {
        self.samples.push(x);
    }
    pub fn median(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        if n == 0 {
            return f64::NAN;
        }
        if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        }
    }
    pub fn min(&self) -> f64 {
        self.samples.iter().copied().fold(f64::INFINITY, f64::min)
    }
    pub fn max(&self) -> f64 {
        self.samples
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max)
    }
}

/// Per-round ratios of `a` to `b`.
pub fn ratios(a: &Row, b: &Row) -> Row {
    Row {
        samples: a
            .samples
            .iter()
            .zip(&b.samples)
            .map(|(x, y)| x / y)
            .collect(),
    }
}

/// Per-round differences `a - b`, scaled by `scale` (paired rows).
pub fn differences(a: &Row, b: &Row, scale: f64) -> Row {
    Row {
        samples: a
            .samples
            .iter()
            .zip(&b.samples)
            .map(|(x, y)| (x - y) * scale)
            .collect(),
    }
}

pub fn header(title: &str) {
    println!("\n{title}\n");
    println!(
        "{:<52} {:>10} {:>21} {:>9}",
        "row", "median", "spread (min..max)", "vs raw"
    );
}

/// One table line; `ratio` is the median per-round ratio to the raw row.
pub fn line(name: &str, row: &Row, unit: &str, ratio: Option<&Row>) {
    let ratio = ratio.map_or(String::from("-"), |q| format!("{:.3}", q.median()));
    println!(
        "{:<52} {:>7.3} {unit:<2} {:>10.3}..{:<8.3} {:>9}",
        name,
        row.median(),
        row.min(),
        row.max(),
        ratio
    );
}

/// Seconds `f` takes.
pub fn time(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// `--rounds N`, else `default` (`quick` with `--quick`).
pub fn rounds(default: usize, quick: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--quick") {
        return quick;
    }
    args.iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn is_quick() -> bool {
    std::env::args().any(|a| a == "--quick")
}
