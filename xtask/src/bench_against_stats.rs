//! The verdict of `cargo xtask bench --against`: each row's ratio (this checkout / REV) with a
//! bootstrap 95 % interval, judged against the 5 % rule. A row is "ok" only when the whole
//! interval is at or under the target, "slower" only when the whole interval is over it, and
//! "not shown" when the interval straddles it: the run did not measure finely enough to say.
//!
//! Two ratios: of the two medians ([`ratio_ci`], each side resampled on its own), and of the
//! pairs ([`paired_ci`]): the samples are taken in pairs, one of each build back to back, so
//! the k-th sample of each side belong together and what the machine did at that moment falls
//! on both; the pairs' ratio is the median of the per-pair ratios, its interval from resampling
//! whole pairs. The verdict is the paired one.

use std::time::Duration;

/// Resamples of the bootstrap.
const RESAMPLES: usize = 2000;

/// A row's ratio of medians and its 95 % bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatioCi {
    pub ratio: f64,
    pub lo: f64,
    pub hi: f64,
}

/// What a row's interval says about the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The whole interval is at or under the target.
    Ok,
    /// The whole interval is over the target.
    Slower,
    /// The interval straddles the target.
    NotShown,
}

impl RatioCi {
    pub fn verdict(&self, target: f64) -> Verdict {
        if self.hi <= target {
            Verdict::Ok
        } else if self.lo > target {
            Verdict::Slower
        } else {
            Verdict::NotShown
        }
    }
}

/// median(`new`) / median(`old`), with the 2.5th and 97.5th percentiles of that ratio over
/// bootstrap resamples (each side resampled with replacement, independently). Deterministic:
/// the resampling is driven by `seed`. `None` when a side has no sample.
pub fn ratio_ci(old: &[Duration], new: &[Duration], seed: u64) -> Option<RatioCi> {
    if old.is_empty() || new.is_empty() {
        return None;
    }
    let a: Vec<f64> = old.iter().map(Duration::as_secs_f64).collect();
    let b: Vec<f64> = new.iter().map(Duration::as_secs_f64).collect();
    let ratio = median(&b) / median(&a).max(1e-12);
    let mut rng = XorShift(seed | 1);
    let (mut ra, mut rb) = (vec![0.0; a.len()], vec![0.0; b.len()]);
    let (lo, hi) = interval(|| {
        resample(&mut ra, &a, &mut rng);
        resample(&mut rb, &b, &mut rng);
        median(&rb) / median(&ra).max(1e-12)
    });
    Some(RatioCi { ratio, lo, hi })
}

/// Fill `into` with draws (with replacement) from `from`.
fn resample(into: &mut [f64], from: &[f64], rng: &mut XorShift) {
    for x in into.iter_mut() {
        *x = from[rng.below(from.len())];
    }
}

/// The 2.5th and 97.5th percentiles of `stat` over [`RESAMPLES`] calls (one per resample).
fn interval(mut stat: impl FnMut() -> f64) -> (f64, f64) {
    let mut v: Vec<f64> = (0..RESAMPLES).map(|_| stat()).collect();
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.025), at(0.975))
}

/// exp(median over k of ln(new[k] / old[k])): the ratio of a typical pair, with the 2.5th and
/// 97.5th percentiles of the same statistic over bootstrap resamples of whole pairs. `old[k]`
/// and `new[k]` must be the two samples of one pair (a longer side's extra samples are left
/// out). Deterministic in `seed`; `None` without a pair.
pub fn paired_ci(old: &[Duration], new: &[Duration], seed: u64) -> Option<RatioCi> {
    let d: Vec<f64> = old
        .iter()
        .zip(new)
        .map(|(a, b)| (b.as_secs_f64().max(1e-12) / a.as_secs_f64().max(1e-12)).ln())
        .collect();
    if d.is_empty() {
        return None;
    }
    let mut rng = XorShift(seed | 1);
    let mut r = vec![0.0; d.len()];
    let (lo, hi) = interval(|| {
        resample(&mut r, &d, &mut rng);
        median(&r)
    });
    Some(RatioCi {
        ratio: median(&d).exp(),
        lo: lo.exp(),
        hi: hi.exp(),
    })
}

/// The median (the mean of the two middle values for an even count). `v` is not empty.
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// A small deterministic generator (xorshift64) for the resampling.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_micros(m * 1000)).collect()
    }

    /// Samples around `center` ms with a spread of +-`spread` %, from a fixed sequence.
    fn around(center: f64, spread: f64, n: usize, seed: u64) -> Vec<Duration> {
        let mut r = XorShift(seed);
        (0..n)
            .map(|_| {
                let u = r.below(10_001) as f64 / 10_000.0 * 2.0 - 1.0;
                Duration::from_secs_f64(center * (1.0 + spread / 100.0 * u) / 1000.0)
            })
            .collect()
    }

    #[test]
    fn equal_tight_samples_are_ok() {
        let a = around(100.0, 2.0, 200, 7);
        let b = around(100.0, 2.0, 200, 11);
        let ci = ratio_ci(&a, &b, 1).unwrap();
        assert!((ci.ratio - 1.0).abs() < 0.02, "{ci:?}");
        assert!(ci.lo <= ci.ratio && ci.ratio <= ci.hi, "{ci:?}");
        assert_eq!(ci.verdict(1.05), Verdict::Ok, "{ci:?}");
    }

    #[test]
    fn a_clearly_slower_build_is_slower() {
        let a = around(100.0, 2.0, 200, 7);
        let b = around(115.0, 2.0, 200, 11);
        let ci = ratio_ci(&a, &b, 1).unwrap();
        assert!(ci.lo > 1.10, "{ci:?}");
        assert_eq!(ci.verdict(1.05), Verdict::Slower, "{ci:?}");
    }

    #[test]
    fn few_noisy_samples_do_not_show_either_way() {
        let a = ms(&[90, 120, 100]);
        let b = ms(&[95, 130, 104]);
        let ci = ratio_ci(&a, &b, 1).unwrap();
        assert!(ci.lo < 1.0 && ci.hi > 1.05, "{ci:?}");
        assert_eq!(ci.verdict(1.05), Verdict::NotShown, "{ci:?}");
    }

    #[test]
    fn pairs_cancel_what_both_sides_share() {
        // Each pair shares a load factor of 1x-3x (the machine at that moment); the new build
        // is 3 % faster within every pair. The medians' ratio cannot see it through the load;
        // the pairs' ratio does.
        let load = around(2.0, 50.0, 60, 13);
        let old: Vec<Duration> = load.iter().map(|l| l.mul_f64(100.0)).collect();
        let new: Vec<Duration> = load.iter().map(|l| l.mul_f64(97.0)).collect();
        let by_medians = ratio_ci(&old, &new, 1).unwrap();
        assert_eq!(
            by_medians.verdict(1.05),
            Verdict::NotShown,
            "{by_medians:?}"
        );
        let paired = paired_ci(&old, &new, 1).unwrap();
        assert!((paired.ratio - 0.97).abs() < 1e-9, "{paired:?}");
        assert_eq!(paired.verdict(1.05), Verdict::Ok, "{paired:?}");
        // A 10 % slower build within every pair is slower, however noisy the load.
        let slow: Vec<Duration> = load.iter().map(|l| l.mul_f64(110.0)).collect();
        assert_eq!(
            paired_ci(&old, &slow, 1).unwrap().verdict(1.05),
            Verdict::Slower
        );
        assert_eq!(paired_ci(&[], &slow, 1), None);
    }

    #[test]
    fn the_interval_is_deterministic_and_needs_samples() {
        let a = around(50.0, 10.0, 40, 3);
        let b = around(52.0, 10.0, 40, 5);
        assert_eq!(ratio_ci(&a, &b, 9), ratio_ci(&a, &b, 9));
        assert_eq!(ratio_ci(&[], &b, 9), None);
        assert_eq!(median(&[3.0, 1.0, 2.0, 10.0]), 2.5);
    }
}
