//! Where a host's CPU goes during a convergence: samples of its process (`perf record`,
//! call graphs) attributed to the stages of a reconcile, and the table BENCHMARKS.md shows.
//!
//! A sample belongs to a stage by two rules, in order. A plugin call runs on the runtime's
//! own threads (`wasmctrl-call`), so a sample there is the plugin call, unless the runtime is
//! checking the plugin's answer (`wasmctrl_runtime::call::accept`: validation). Anywhere
//! else, the innermost frame that names a stage decides: a Deployment built by the plugin,
//! then serialized for the API server, counts as the write, not as serialization. Samples
//! outside every reconcile are sorted by what they are doing (watches and caches, the queue,
//! HTTP and TLS, the async runtime, the allocator); a sample under a reconcile that names no
//! stage counts as "reconcile, unattributed", which measures what inlining hides.

use std::collections::BTreeMap;

/// One sample: its thread's name, its weight (`period`: nanoseconds for `cpu-clock`), and
/// its frames' symbols, innermost first.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The thread's name (`comm`).
    pub thread: String,
    /// The weight `perf` gave it.
    pub period: u64,
    /// Demangled symbols, innermost first; `[unknown]` where perf had none.
    pub frames: Vec<String>,
}

/// The stages a sample is put in, in the order the table shows them.
pub const STAGES: [&str; 15] = [
    "cache reads and request build",
    "plugin call",
    "validation and stamping",
    "SSA body build and write",
    "status",
    "Events",
    "explain record",
    "metrics",
    "reconcile, unattributed",
    "watches and caches",
    "queue",
    "HTTP and TLS",
    "async runtime and scheduling",
    "allocator",
    "other",
];

/// Which frames mark a stage of a reconcile: a symbol containing any of the patterns.
const RECONCILE_STAGES: [(&str, &[&str]); 8] = [
    (
        "cache reads and request build",
        &[
            "reconcile::request::",
            "reconcile::serving::",
            "cache::cached::",
            "cache::read_cache::",
            "cache::related::",
        ],
    ),
    (
        "plugin call",
        &[
            "wasmctrl_runtime::plugin::",
            "wasmctrl_runtime::call_slots::",
            "wasmctrl_runtime::call_threads::",
            "wasmctrl_runtime::sandbox::",
        ],
    ),
    (
        "validation and stamping",
        &[
            "wasmctrl_runtime::call::accept",
            "children::validate::",
            "children::stamp::",
        ],
    ),
    (
        "SSA body build and write",
        &[
            "reconcile::writes::apply_child",
            "reconcile::writes::create_child",
            "reconcile::writes::update_child",
            "reconcile::writes::prune",
            "children::converge::",
            "children::prune::",
            "cache::field_ownership::",
        ],
    ),
    (
        "status",
        &[
            "reconcile::writes::write_status",
            "reconcile::writes::apply_status",
            "reconcile::writes::write_failure_status",
            "reconcile::status::",
        ],
    ),
    ("Events", &["reconcile::events::", "kube_runtime::events"]),
    (
        "explain record",
        &[
            "reconcile::trace::",
            "wasmctrl::case::",
            "wasmctrl::explain::",
        ],
    ),
    ("metrics", &["wasmctrl::metrics::", "prometheus_client::"]),
];

/// A frame that says the sample is inside a reconcile.
const IN_RECONCILE: &str = "controller::reconcile::";

/// What a sample outside every stage is doing, by its innermost matching frame.
const OUTSIDE: [(&str, &[&str]); 5] = [
    (
        "watches and caches",
        &[
            "kube_runtime::watcher",
            "kube_runtime::reflector",
            "controller::cache::",
            "policy_run::watches::",
            "serde_json::de::",
        ],
    ),
    (
        "queue",
        &["kube_runtime::controller", "kube_runtime::scheduler"],
    ),
    (
        "HTTP and TLS",
        &[
            "hyper::",
            "hyper_util::",
            "h2::",
            "rustls::",
            "ring::",
            "tower::",
            "kube_client::",
        ],
    ),
    ("allocator", &["_rjem", "jemalloc", "tikv_jemalloc"]),
    (
        "async runtime and scheduling",
        &["tokio::", "mio::", "__schedule", "futex"],
    ),
];

/// The threads a plugin call runs on.
const CALL_THREAD: &str = "wasmctrl-call";

/// The stage of one sample (one of [`STAGES`]).
pub fn stage_of(sample: &Sample) -> &'static str {
    if sample.thread.starts_with(CALL_THREAD) {
        let validating = sample
            .frames
            .iter()
            .any(|f| f.contains("wasmctrl_runtime::call::accept"));
        return if validating {
            "validation and stamping"
        } else {
            "plugin call"
        };
    }
    // The stages of a reconcile count only under one: a watch event decoded into the cache
    // is the watches' work, not a cache read for a request.
    if sample.frames.iter().any(|f| f.contains(IN_RECONCILE)) {
        for frame in &sample.frames {
            for (stage, patterns) in RECONCILE_STAGES {
                if patterns.iter().any(|p| frame.contains(p)) {
                    return stage;
                }
            }
        }
        return "reconcile, unattributed";
    }
    for frame in &sample.frames {
        for (stage, patterns) in OUTSIDE {
            if patterns.iter().any(|p| frame.contains(p)) {
                return stage;
            }
        }
    }
    "other"
}

/// The samples of `perf script` output (`-F comm,tid,period,ip,sym`, call graphs): a header
/// line per sample (`COMM TID PERIOD` and perhaps more fields), then one indented line per
/// frame (`ADDRESS SYMBOL[+OFFSET] [(DSO)]`), then a blank line.
pub fn parse_perf_script(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut current: Option<Sample> = None;
    for line in text.lines() {
        if line.trim().is_empty() {
            samples.extend(current.take());
            continue;
        }
        if line.starts_with(char::is_whitespace) {
            if let Some(sample) = current.as_mut() {
                sample.frames.push(frame_symbol(line));
            }
            continue;
        }
        samples.extend(current.take());
        current = header(line);
    }
    samples.extend(current);
    samples
}

/// `COMM TID PERIOD[:]`: read from the right, as the thread name may hold spaces and end
/// in a number itself.
fn header(line: &str) -> Option<Sample> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [.., tid, period] = fields.as_slice() else {
        return None;
    };
    let numeric =
        |s: &str| !s.is_empty() && s.split('/').all(|p| p.chars().all(|c| c.is_ascii_digit()));
    if fields.len() < 3 || !numeric(tid) {
        return None;
    }
    Some(Sample {
        thread: fields[..fields.len() - 2].join(" "),
        period: period.trim_end_matches(':').parse().ok()?,
        frames: Vec::new(),
    })
}

/// The demangled symbol of a frame line, without its address, offset and DSO.
fn frame_symbol(line: &str) -> String {
    let line = line.trim();
    let rest = line.split_once(char::is_whitespace).map_or("", |(_, r)| r);
    let rest = match rest.rfind(" (") {
        Some(at) if rest.ends_with(')') => &rest[..at],
        _ => rest,
    };
    let symbol = match rest.rfind("+0x") {
        Some(at) => &rest[..at],
        None => rest,
    };
    format!("{:#}", rustc_demangle::demangle(symbol.trim()))
}

/// CPU per stage, in the weight's unit, every stage present (zero where none).
pub fn by_stage(samples: &[Sample]) -> BTreeMap<&'static str, u64> {
    let mut totals: BTreeMap<&'static str, u64> = STAGES.iter().map(|s| (*s, 0)).collect();
    for sample in samples {
        *totals.entry(stage_of(sample)).or_default() += sample.period;
    }
    totals
}

/// The Markdown table: per stage, CPU seconds, share of the sampled total, and microseconds
/// per reconcile and per plugin call. `period_ns` is the weight's unit in nanoseconds
/// (1 for `cpu-clock`, whose period is nanoseconds).
pub fn table(
    totals: &BTreeMap<&'static str, u64>,
    period_ns: f64,
    reconciles: u64,
    plugin_calls: u64,
) -> String {
    let all: u64 = totals.values().sum();
    let mut out = String::from(
        "| stage | CPU s | % of host | µs per reconcile | µs per plugin call |\n|---|---:|---:|---:|---:|\n",
    );
    for stage in STAGES {
        let weight = totals.get(stage).copied().unwrap_or_default();
        let seconds = weight as f64 * period_ns / 1e9;
        let share = if all == 0 {
            0.0
        } else {
            100.0 * weight as f64 / all as f64
        };
        let per = |n: u64| {
            if n == 0 {
                "-".to_owned()
            } else {
                format!("{:.0}", seconds * 1e6 / n as f64)
            }
        };
        out.push_str(&format!(
            "| {stage} | {seconds:.2} | {share:.1} | {} | {} |\n",
            per(reconciles),
            per(plugin_calls)
        ));
    }
    out.push_str(&format!(
        "| **all sampled** | {:.2} | 100.0 | {} | {} |\n",
        all as f64 * period_ns / 1e9,
        if reconciles == 0 {
            "-".to_owned()
        } else {
            format!("{:.0}", all as f64 * period_ns / 1e3 / reconciles as f64)
        },
        if plugin_calls == 0 {
            "-".to_owned()
        } else {
            format!("{:.0}", all as f64 * period_ns / 1e3 / plugin_calls as f64)
        },
    ));
    out
}

/// `perf record` of one process, from [`Profiler::start`] until [`Profiler::finish`]: the
/// software `cpu-clock` event (no hardware counters needed) at 499 Hz on every CPU, of which
/// the process's samples are read back; call graphs walked
/// along frame pointers when [`CALL_GRAPH_ENV`] says `fp` (`cargo xtask bench profile`
/// builds the bench with them), unwound from DWARF otherwise.
pub struct Profiler {
    perf: std::process::Child,
    data: std::path::PathBuf,
    pid: u32,
}

/// The environment variable naming the directory a convergence bench profiles its host into.
pub const PROFILE_DIR_ENV: &str = "WASMCTRL_BENCH_PROFILE";

/// How `perf` finds call graphs: `fp` for a build with frame pointers; anything else (or
/// unset) unwinds from DWARF, which copies 16 KiB of stack per sample.
pub const CALL_GRAPH_ENV: &str = "WASMCTRL_BENCH_CALL_GRAPH";

impl Profiler {
    /// Start sampling process `pid` into `dir/perf-<name>.data`.
    pub fn start(pid: u32, dir: &std::path::Path, name: &str) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        std::fs::create_dir_all(dir)?;
        let data = dir.join(format!("perf-{name}.data"));
        let log = std::fs::File::create(dir.join(format!("perf-{name}.log")))?;
        let call_graph = match std::env::var(CALL_GRAPH_ENV).as_deref() {
            Ok("fp") => "fp",
            _ => "dwarf,16384",
        };
        let perf = std::process::Command::new("perf")
            .args(["record", "-e", "cpu-clock", "-F", "499"])
            // Every CPU, not `-p`: a process whose threads come and go leaves perf 6.1
            // polling the events of the exited ones in a busy loop (two thirds of a core
            // on this 2-core machine). `finish` keeps the process's samples only.
            .args(["--call-graph", call_graph, "-m", "16M", "-a"])
            .arg("-o")
            .arg(&data)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context(
                "running perf (Debian's linux-perf; `cargo xtask bench profile` installs it)",
            )?;
        // perf attaches within moments; what it misses of the first ones is noise.
        std::thread::sleep(std::time::Duration::from_millis(500));
        let mut perf = perf;
        if let Some(status) = perf.try_wait()? {
            anyhow::bail!(
                "perf record exited at once ({status}): {}",
                std::fs::read_to_string(dir.join(format!("perf-{name}.log"))).unwrap_or_default()
            );
        }
        Ok(Self { perf, data, pid })
    }

    /// Stop sampling and read the samples back, with `perf script` writing its text beside the
    /// data (for drill-down).
    #[allow(unsafe_code)] // see the SAFETY comment inside
    pub fn finish(mut self) -> anyhow::Result<Vec<Sample>> {
        use anyhow::{Context as _, ensure};
        let perf_pid = libc::pid_t::try_from(self.perf.id())?;
        // SAFETY: kill(2) on our own child's pid has no memory effects. SIGINT makes perf
        // write its data and exit.
        let signalled = unsafe { libc::kill(perf_pid, libc::SIGINT) } == 0;
        ensure!(signalled, "could not signal perf");
        let status = self.perf.wait()?;
        use std::os::unix::process::ExitStatusExt as _;
        ensure!(
            status.success() || status.code() == Some(130) || status.signal() == Some(libc::SIGINT),
            "perf record failed ({status}); see its log beside {}",
            self.data.display()
        );
        let output = std::process::Command::new("perf")
            .args([
                "script",
                "--no-inline",
                "-F",
                "comm,tid,period,ip,sym,dso",
                "--pid",
            ])
            .arg(self.pid.to_string())
            .arg("-i")
            .arg(&self.data)
            .output()
            .context("running perf script")?;
        ensure!(
            output.status.success(),
            "perf script failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let text = String::from_utf8_lossy(&output.stdout);
        std::fs::write(self.data.with_extension("txt"), text.as_bytes())?;
        Ok(parse_perf_script(&text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `perf script -F comm,tid,period,ip,sym,dso` prints for three samples.
    const SCRIPT: &str = "\
wasmctrl-call 4242 1002004:
\t    55d0a1 wasmtime::runtime::func::Func::call_impl+0x51 (/bench)
\t    55d0a2 wasmctrl_runtime::plugin::Plugin::reconcile_as+0x10 (/bench)

tokio-runtime-w 4240 2004008:
\t    55d0b1 serde_json::ser::to_vec+0x20 (/bench)
\t    55d0b2 wasmctrl::controller::reconcile::writes::apply_child::{{closure}}+0x8 (/bench)
\t    55d0b3 wasmctrl::controller::reconcile::steps::Reconcile::run+0x2 (/bench)
\t    55d0b4 tokio::runtime::task::raw::poll+0x4 (/bench)

tokio-runtime-w 4241 1000000:
\t    55d0c1 rustls::conn::ConnectionCommon::write_tls+0x11 (/bench)
\t    55d0c2 hyper::proto::h1::dispatch::Dispatcher::poll+0x1 (/bench)
\t    55d0c3 tokio::runtime::task::raw::poll+0x4 (/bench)
";

    #[test]
    fn samples_are_read_with_their_threads_weights_and_frames() {
        let samples = parse_perf_script(SCRIPT);
        assert_eq!(samples.len(), 3);
        assert_eq!(samples[0].thread, "wasmctrl-call");
        assert_eq!(samples[0].period, 1_002_004);
        assert_eq!(
            samples[0].frames,
            [
                "wasmtime::runtime::func::Func::call_impl",
                "wasmctrl_runtime::plugin::Plugin::reconcile_as"
            ]
        );
        assert_eq!(samples[1].frames.len(), 4);
        let spaced = parse_perf_script("my worker 3 7 55:\n\t 1 f (/x)\n");
        assert_eq!(spaced[0].thread, "my worker 3");
        assert_eq!(spaced[0].period, 55);
    }

    #[test]
    fn the_innermost_stage_frame_decides_and_call_threads_are_the_plugin() {
        let samples = parse_perf_script(SCRIPT);
        let stages: Vec<&str> = samples.iter().map(stage_of).collect();
        assert_eq!(
            stages,
            ["plugin call", "SSA body build and write", "HTTP and TLS"]
        );
        let validating = Sample {
            thread: "wasmctrl-call-1".into(),
            period: 1,
            frames: vec!["wasmctrl_runtime::call::accept".into()],
        };
        assert_eq!(stage_of(&validating), "validation and stamping");
        let hidden = Sample {
            thread: "tokio-runtime-w".into(),
            period: 1,
            frames: vec![
                "core::ptr::drop_in_place".into(),
                "wasmctrl::controller::reconcile::steps::Reconcile::run".into(),
            ],
        };
        assert_eq!(stage_of(&hidden), "reconcile, unattributed");
        let watching = Sample {
            thread: "tokio-runtime-w".into(),
            period: 1,
            frames: vec![
                "wasmctrl::controller::cache::cached::CachedObject::new".into(),
                "kube_runtime::reflector::store::Writer::apply_watcher_event".into(),
            ],
        };
        assert_eq!(
            stage_of(&watching),
            "watches and caches",
            "no reconcile frame"
        );
        let mangled =
            frame_symbol("\t 1 _ZN8wasmctrl7metrics7Metrics6record17h0123456789abcdefE+0x1 (/x)");
        assert_eq!(mangled, "wasmctrl::metrics::Metrics::record");
    }

    #[test]
    fn the_table_shares_the_sampled_total_and_divides_by_reconciles() {
        let samples = parse_perf_script(SCRIPT);
        let totals = by_stage(&samples);
        assert_eq!(totals.len(), STAGES.len());
        let table = table(&totals, 1.0, 2, 1);
        assert!(
            table.contains("| plugin call | 0.00 | 25.0 | 501 | 1002 |"),
            "{table}"
        );
        assert!(
            table.contains("| SSA body build and write | 0.00 | 50.0 | 1002 | 2004 |"),
            "{table}"
        );
        assert!(
            table.contains("| **all sampled** | 0.00 | 100.0 | 2003 | 4006 |"),
            "{table}"
        );
    }
}
