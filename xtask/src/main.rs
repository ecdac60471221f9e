//! `cargo xtask`: the project's build automation (host side only).
//!
//! Owns: installing Debian build dependencies (`deps`), the static release binary (`dist`),
//! the guest images (`images`), the CI pipeline (`ci`) and on-demand fuzzing (`fuzz`). Never
//! touches anything outside the checkout, the image cache (`/var/cache/tryboxi` or
//! `$TRYBOXI_IMAGE_CACHE`), for `deps` apt's sources and packages, and for `fuzz` the cargo-fuzz
//! install in `~/.cargo/bin`.

mod apt_sources;
mod bench;
mod bench_against;
mod bench_against_stats;
mod bench_curves;
mod bench_curves_plot;
mod bench_density;
mod bench_e2b;
mod bench_load;
mod bench_net;
mod bench_peer;
mod bench_secrets;
mod bench_snap;
mod bench_ws;
mod ci;
mod daemon;
mod demo;
mod deps;
mod deps_harness;
mod dist;
mod elf;
mod fuzz;
mod http;
mod images;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Rebuildable {
    Kernel,
    Rootfs,
}

/// `cargo xtask images --kernel`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
enum KernelChoice {
    /// Our tuned build from linux-source-6.12 (~6 min on 2 cores, cached).
    #[default]
    Built,
    /// Debian's packaged cloud kernel 6.12 + its modules in the initramfs (seconds).
    Packaged,
}

#[derive(Parser)]
#[command(name = "cargo xtask", about = "tryboxi build automation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the Debian packages the build needs (idempotent; needs root).
    Deps,
    /// Build the static release binary into _out/bin/ (plus its argv[0] symlinks).
    Dist,
    /// Build (or reuse from the cache) the guest kernel, rootfs and initramfs into _out/images/,
    /// with the template layers asked for (`--template`, `--all`).
    Images {
        /// Do not run `dist` first; use the existing _out/bin/tryboxi for the initramfs.
        #[arg(long)]
        no_dist: bool,
        /// Rebuild this artifact even if the cache has it (`kernel` or `rootfs`; repeatable).
        /// Useful to pick up Debian updates, since the rootfs key does not change with them.
        #[arg(long, value_enum)]
        rebuild: Vec<Rebuildable>,
        /// Also build this template layer (a recipe in guest-image/templates/: go, node,
        /// python, rust, code-interpreter; repeatable). A layer not asked for is shipped only
        /// when the image cache already has it.
        #[arg(long = "template")]
        templates: Vec<String>,
        /// Build every template layer except the on-demand ones (go, node, python, rust;
        /// ~20-40 s each the first time); `--template code-interpreter` adds that one.
        #[arg(long)]
        all: bool,
        /// Which guest kernel: our tuned build, or Debian's packaged cloud kernel (runs with
        /// `microvm,acpi=on`; see docs/VMM.md, "Kernel plan").
        #[arg(long, value_enum, default_value_t)]
        kernel: KernelChoice,
    },
    /// Everything CI runs: deps, fmt, clippy, dist, images, tests.
    Ci,
    /// The main job: set up, start the daemon, create a sandbox for a repo, run commands in it.
    Demo {
        /// The repo to use as the sandbox's workspace (default: this checkout).
        #[arg(long)]
        repo: Option<std::path::PathBuf>,
    },
    /// Run the cargo-fuzz targets in fuzz/ (installs cargo-fuzz if absent), one at a time, each
    /// for a CPU budget; prints execs, coverage, peak RSS and crashes per target. New inputs go
    /// to target/fuzz-scratch/<target>/new/ (and into fuzz/corpus/<target>/ with --save).
    Fuzz {
        /// Only this target (repeatable; default: all of them).
        #[arg(long = "target")]
        targets: Vec<String>,
        /// CPU-minutes per target.
        #[arg(long, default_value_t = 10.0)]
        minutes: f64,
        /// Wall-clock minutes per target at most (default: 4x --minutes).
        #[arg(long)]
        wall_minutes: Option<f64>,
        /// Merge new interesting inputs into the repository's corpus.
        #[arg(long)]
        save: bool,
        /// libFuzzer's -rss_limit_mb.
        #[arg(long, default_value_t = 2048)]
        rss_limit_mb: u64,
        /// libFuzzer's -malloc_limit_mb (one allocation above it is a crash).
        #[arg(long, default_value_t = 256)]
        malloc_limit_mb: u64,
    },
    /// Boot and exec benchmarks against a bare-QEMU baseline; writes BENCHMARKS.md.
    Bench {
        /// Repetitions per measurement (at least 5).
        #[arg(long, default_value_t = 7)]
        reps: usize,
        /// Run only the workspace rows (e) and replace that section of BENCHMARKS.md.
        #[arg(long, conflicts_with = "secrets_only")]
        workspace_only: bool,
        /// Run only the secrets rows (k), (l) and replace that section of BENCHMARKS.md.
        #[arg(long)]
        secrets_only: bool,
        /// Run only the E2B SDK row (m) and replace that section of BENCHMARKS.md.
        #[arg(long, conflicts_with_all = ["secrets_only", "workspace_only"])]
        e2b_only: bool,
        /// Run only the sustained-load row (n) and replace that section of BENCHMARKS.md.
        #[arg(long, conflicts_with_all = ["secrets_only", "workspace_only", "e2b_only"])]
        load_only: bool,
        /// Seconds of sustained load for row (n).
        #[arg(long, default_value_t = 60)]
        load_secs: u64,
        /// Run only the workspace cost curves and replace that section of BENCHMARKS.md (and
        /// bench-curves.svg).
        #[arg(long, conflicts_with_all = ["secrets_only", "workspace_only", "e2b_only", "load_only"])]
        curves_only: bool,
        /// Tree sizes (files) of the cost curves.
        #[arg(long, value_delimiter = ',', default_values_t = [1000usize, 10_000, 100_000])]
        curve_sizes: Vec<usize>,
        /// Wall-clock budget of one cost-curve row (one operation at one size), in seconds.
        #[arg(long, default_value_t = 300)]
        row_budget_secs: u64,
        /// Repetitions of each cost-curve row (fewer when its budget runs out).
        #[arg(long, default_value_t = 5)]
        curve_reps: usize,
        /// Run only the density row (p) and replace that section of BENCHMARKS.md.
        #[arg(long, conflicts_with_all = ["secrets_only", "workspace_only", "e2b_only", "load_only", "curves_only"])]
        density_only: bool,
        /// Forks of one sandbox alive at once in row (p).
        #[arg(long, default_value_t = 100)]
        density_count: usize,
        /// Independent creates alive at once in row (p), apart from the forks.
        #[arg(long, default_value_t = 20)]
        density_creates: usize,
        /// Seconds over which row (p) measures the idle QEMUs' CPU.
        #[arg(long, default_value_t = 30)]
        density_idle_secs: u64,
        /// Wall-clock budget of row (p), in seconds: it stops early and says so past it.
        #[arg(long, default_value_t = 1800)]
        density_budget_secs: u64,
        /// Only the core rows, for REV (a commit, built in a worktree by its own xtask) and
        /// for this checkout, interleaved in one run, with the ratios; replaces that section
        /// of BENCHMARKS.md.
        #[arg(long, value_name = "REV", conflicts_with_all = ["secrets_only", "workspace_only", "e2b_only", "load_only", "curves_only", "density_only"])]
        against: Option<String>,
        /// Rounds of `--against` (one daemon of each build per round, both alive, samples
        /// taken in pairs).
        #[arg(long, default_value_t = 3)]
        against_rounds: usize,
        /// With `--against`: give REV its own whole image set (kernel, rootfs, initramfs)
        /// instead of its own initramfs with this checkout's kernel and rootfs.
        #[arg(long, requires = "against")]
        against_own_images: bool,
        /// Run only the native-peer network rows (the stack at native speed) and replace that
        /// section of BENCHMARKS.md.
        #[arg(long, conflicts_with_all = ["secrets_only", "workspace_only", "e2b_only", "load_only", "curves_only", "density_only", "against"])]
        net_peer_only: bool,
    },
}

/// The cost curves' options from the command line (sizes checked: 1 to 1,000,000 files).
fn curve_options(
    sizes: Vec<usize>,
    budget_secs: u64,
    reps: usize,
) -> Result<bench_curves::Options> {
    if sizes.is_empty() || sizes.iter().any(|&n| n == 0 || n > 1_000_000) {
        anyhow::bail!("--curve-sizes: 1 to 1,000,000 files each, e.g. 1000,10000,100000");
    }
    let mut sizes = sizes;
    sizes.sort_unstable();
    sizes.dedup();
    Ok(bench_curves::Options {
        sizes,
        row_budget: std::time::Duration::from_secs(budget_secs.max(1)),
        reps: reps.max(1),
    })
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Deps => deps::run(),
        Cmd::Dist => dist::run().map(|_| ()),
        Cmd::Images {
            no_dist,
            rebuild,
            templates,
            all,
            kernel,
        } => {
            let binary = if no_dist {
                util::out_dir().join("bin").join("tryboxi")
            } else {
                dist::run()?
            };
            let rebuild = images::Rebuild {
                kernel: rebuild.contains(&Rebuildable::Kernel),
                rootfs: rebuild.contains(&Rebuildable::Rootfs),
            };
            let wanted = images::template::Wanted {
                standard: all,
                every: false,
                names: templates,
            };
            let choice = images::Choice {
                kernel: match kernel {
                    KernelChoice::Built => images::kernel::Flavor::Built,
                    KernelChoice::Packaged => images::kernel::Flavor::Packaged,
                },
            };
            images::run(&binary, rebuild, &wanted, choice).map(|_| ())
        }
        Cmd::Ci => ci::run(),
        Cmd::Demo { repo } => demo::run(repo),
        Cmd::Fuzz {
            targets,
            minutes,
            wall_minutes,
            save,
            rss_limit_mb,
            malloc_limit_mb,
        } => fuzz::run(fuzz::Options {
            targets,
            minutes,
            wall_minutes,
            save,
            rss_limit_mb,
            malloc_limit_mb,
        }),
        Cmd::Bench {
            against: Some(rev),
            against_rounds,
            against_own_images,
            reps,
            ..
        } => bench_against::run(&rev, against_rounds, reps, against_own_images),
        Cmd::Bench {
            curves_only: true,
            curve_sizes,
            row_budget_secs,
            curve_reps,
            ..
        } => bench_curves::run_only(curve_options(curve_sizes, row_budget_secs, curve_reps)?),
        Cmd::Bench {
            secrets_only: true, ..
        } => bench::run_secrets_only(),
        Cmd::Bench {
            density_only: true,
            density_count,
            density_creates,
            density_idle_secs,
            density_budget_secs,
            ..
        } => bench::run_density_only(bench_density::DensityArgs {
            forks: density_count,
            creates: density_creates,
            idle_secs: density_idle_secs,
            budget_secs: density_budget_secs,
        }),
        Cmd::Bench {
            load_only: true,
            load_secs,
            ..
        } => bench::run_load_only(load_secs),
        Cmd::Bench {
            net_peer_only: true,
            ..
        } => bench::run_net_peer_only(),
        Cmd::Bench {
            reps,
            e2b_only: true,
            ..
        } => bench::run_e2b_only(reps),
        Cmd::Bench {
            reps,
            load_secs,
            workspace_only: false,
            curve_sizes,
            row_budget_secs,
            curve_reps,
            density_count,
            density_creates,
            density_idle_secs,
            density_budget_secs,
            ..
        } => bench::run(
            reps,
            load_secs,
            curve_options(curve_sizes, row_budget_secs, curve_reps)?,
            bench_density::DensityArgs {
                forks: density_count,
                creates: density_creates,
                idle_secs: density_idle_secs,
                budget_secs: density_budget_secs,
            },
        ),
        Cmd::Bench {
            reps,
            workspace_only: true,
            ..
        } => bench::run_workspace_only(reps),
    }
}
