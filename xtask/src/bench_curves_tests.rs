use std::time::Duration;

use super::*;

fn ms(v: &[u64]) -> Row {
    Row::Measured(v.iter().map(|&m| Duration::from_millis(m)).collect())
}

/// 1k and 10k measured (first sync 2x rsync at 10k), 100k: first sync over budget.
fn sample() -> Curves {
    let skipped = || Row::Skipped("the first sync went over budget".into());
    Curves {
        sizes: vec![
            SizeRows {
                files: 1000,
                bytes: 10_240_000,
                rows: vec![
                    ms(&[40, 50, 60]),
                    ms(&[100]),
                    ms(&[90]),
                    ms(&[30]),
                    ms(&[200]),
                    ms(&[10]),
                    ms(&[20]),
                ],
            },
            SizeRows {
                files: 10_000,
                bytes: 102_400_000,
                rows: vec![
                    ms(&[400]),
                    ms(&[800, 900, 700]),
                    ms(&[750]),
                    ms(&[40]),
                    ms(&[2000]),
                    ms(&[12]),
                    ms(&[22]),
                ],
            },
            SizeRows {
                files: 100_000,
                bytes: 1_024_000_000,
                rows: vec![
                    ms(&[4000]),
                    Row::OverBudget(Duration::from_secs(301)),
                    skipped(),
                    skipped(),
                    skipped(),
                    skipped(),
                    skipped(),
                ],
            },
        ],
        accel: "tcg".into(),
        budget: Duration::from_secs(300),
        load_before: "1 1 1".into(),
        load_after: "2 2 2".into(),
    }
}

#[test]
fn a_budget_allows_another_repetition_only_while_one_like_the_last_fits() {
    let mut b = Budget::new(Duration::from_secs(10));
    assert!(b.another());
    assert_eq!(b.remaining(), Duration::from_secs(10));
    b.add(Duration::from_secs(4));
    assert!(b.another(), "4 + 4 <= 10");
    b.add(Duration::from_secs(4));
    assert!(!b.another(), "8 + 4 > 10");
    assert_eq!(b.remaining(), Duration::from_secs(2));
    b.add(Duration::from_secs(4));
    assert_eq!(b.remaining(), Duration::ZERO);
}

#[test]
fn growth_is_the_ratio_of_time_per_file() {
    let s = |m| Duration::from_millis(m);
    assert!((growth((10_000, s(500)), (100_000, s(5000))) - 1.0).abs() < 1e-9);
    assert!((growth((10_000, s(500)), (100_000, s(10_000))) - 2.0).abs() < 1e-9);
    assert!((growth((1000, s(100)), (10_000, s(100))) - 0.1).abs() < 1e-9);
}

#[test]
fn the_changed_files_cycle_through_the_trees_directories() {
    assert_eq!(changed_path(1000, 0, 0, "f000.bin"), "d0000/f000.bin");
    assert_eq!(changed_path(1000, 3, 2, "f001.bin"), "d0001/f001.bin");
    assert_eq!(changed_path(100_000, 3, 2, "f001.bin"), "d0011/f001.bin");
    // A tree smaller than one directory still has one.
    assert_eq!(changed_path(50, 5, 1, "f001.bin"), "d0000/f001.bin");
}

#[test]
fn the_section_shows_ratios_to_rsync_over_budget_rows_and_growth() {
    let md = section(&sample(), "2026-12-06 00:00 UTC").unwrap();
    assert!(md.starts_with(HEADING), "{md}");
    assert!(
        md.contains("| 1,000 files (10 MB) | 10,000 files (102 MB) | 100,000 files (1,024 MB) |")
    );
    // rsync is the baseline: no ratio on its own row.
    assert!(md.contains("| `rsync -a` into a local directory (baseline) | 50.0 ms (3) | 400.0 ms (1) | 4.000 s (1) |"), "{md}");
    assert!(
        md.contains("| 100.0 ms (1) **2.00x** | 800.0 ms (3) **2.00x** | over budget (301 s) |"),
        "{md}"
    );
    assert!(md.contains("skipped: the first sync went over budget"));
    assert!(md.contains("First sync / rsync at 10,000 files = **2.00** (target <= 1.0: not met)."));
    // Per file: rsync 50 us at 1k, 40 us at 10k, 40 us at 100k.
    assert!(
        md.contains("- rsync -a: 1k -> 10k: 0.80, 10k -> 100k: 1.00"),
        "{md}"
    );
    assert!(md.contains("- first sync: 1k -> 10k: 0.80\n"), "{md}");
    assert!(md.contains(&format!("]({SVG})")));
}

#[test]
fn the_plot_has_a_line_per_measured_operation_and_none_for_the_others() {
    let mut c = sample();
    for r in &mut c.sizes[0].rows[APPLY..] {
        *r = Row::Skipped("x".into());
    }
    for r in &mut c.sizes[1].rows[APPLY..] {
        *r = Row::OverBudget(Duration::from_secs(301));
    }
    let s = crate::bench_curves_plot::series(&c);
    let names: Vec<_> = s.iter().map(|(n, _, _)| *n).collect();
    assert_eq!(
        names,
        ["rsync -a", "first sync", "delta sync", "first diff", "diff"]
    );
    assert_eq!(
        s[0].2,
        vec![(1000.0, 0.05), (10_000.0, 0.4), (100_000.0, 4.0)]
    );
    assert_eq!(s[1].2.len(), 2, "the 100k first sync was over budget");

    let dir = std::env::temp_dir().join(format!("xtask-curves-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(SVG);
    crate::bench_curves_plot::write_svg(&c, &path).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    for n in &names {
        assert!(svg.contains(&format!(">\n{n}\n</text>")), "no label {n}");
    }
    assert!(!svg.contains("\napply\n"), "apply was never measured");
    // A data line and a legend line per series (axes and ticks are 1 px wide, series 2 or 3).
    let wide = svg
        .lines()
        .filter(|l| l.starts_with("<polyline") && !l.contains("stroke-width=\"1\""))
        .count();
    assert_eq!(wide, 2 * names.len(), "{svg}");
}

#[test]
fn no_measured_row_is_an_error_not_an_empty_plot() {
    let mut c = sample();
    for s in &mut c.sizes {
        for r in &mut s.rows {
            *r = Row::Skipped("x".into());
        }
    }
    let path = std::env::temp_dir().join("xtask-curves-never-written.svg");
    assert!(crate::bench_curves_plot::write_svg(&c, &path).is_err());
}
