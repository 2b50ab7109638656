//! Recording real reconciles to a directory, as case files `wasmctrl plugin replay` runs.
//!
//! Recording must never slow a reconcile or fail one: cases go over a bounded channel to one
//! writer thread, and a case that finds the channel full is dropped and counted. The
//! directory keeps the newest `max_files` cases (over all policies, counting what an earlier
//! run left there), so it cannot fill a disk.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};

use anyhow::Context as _;

use crate::case::Case;

/// Cases waiting for the writer; more are dropped.
const QUEUE: usize = 256;

/// Where and how much to record.
#[derive(Debug, Clone)]
pub struct RecordOptions {
    /// The directory; a subdirectory per policy.
    pub dir: PathBuf,
    /// Cases kept in the directory; the oldest are deleted.
    pub max_files: usize,
    /// Record one reconcile in this many.
    pub one_in: u64,
}

/// Records sampled reconciles as case files.
pub struct Recorder {
    dir: PathBuf,
    sender: SyncSender<Recording>,
    one_in: u64,
    seen: AtomicU64,
    dropped: AtomicU64,
}

struct Recording {
    policy: String,
    namespace: Option<String>,
    name: String,
    case: Case,
}

impl Recorder {
    /// The directory `policy`'s cases are recorded in.
    pub fn policy_dir(&self, policy: &str) -> PathBuf {
        self.dir.join(file_safe(policy))
    }

    /// Start recording to `options.dir`, creating it.
    pub fn start(options: &RecordOptions) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&options.dir)
            .with_context(|| format!("creating the record directory {}", options.dir.display()))?;
        let existing = existing_cases(&options.dir)?;
        let (sender, receiver) = std::sync::mpsc::sync_channel::<Recording>(QUEUE);
        let mut writer = Writer {
            dir: options.dir.clone(),
            max_files: options.max_files.max(1),
            files: existing,
            seq: 0,
        };
        std::thread::Builder::new()
            .name("wasmctrl-recorder".into())
            .spawn(move || {
                for recording in receiver {
                    if let Err(error) = writer.write(&recording) {
                        tracing::warn!(
                            error = format!("{error:#}"),
                            "could not record a reconcile case"
                        );
                    }
                }
            })
            .context("starting the recorder thread")?;
        tracing::info!(dir = %options.dir.display(), max_files = options.max_files, one_in = options.one_in, "recording reconcile cases");
        Ok(Self {
            dir: options.dir.clone(),
            sender,
            one_in: options.one_in.max(1),
            seen: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        })
    }

    /// Whether the next reconcile is one to record (cheap: decide before building a case).
    pub fn sample(&self) -> bool {
        self.seen
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(self.one_in)
    }

    /// Queue `case`, recorded by `policy` for the parent `namespace/name`.
    pub fn record(&self, policy: &str, namespace: Option<&str>, name: &str, case: Case) {
        let recording = Recording {
            policy: policy.to_owned(),
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
            case,
        };
        match self.sender.try_send(recording) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                if self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!("the recorder cannot keep up; cases are being dropped");
                }
            }
            Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Cases dropped because the writer could not keep up.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("one_in", &self.one_in)
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

struct Writer {
    dir: PathBuf,
    max_files: usize,
    /// The cases in the directory, oldest first.
    files: VecDeque<PathBuf>,
    seq: u64,
}

impl Writer {
    fn write(&mut self, recording: &Recording) -> anyhow::Result<()> {
        let dir = self.dir.join(file_safe(&recording.policy));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        self.seq += 1;
        let millis = jiff::Timestamp::now().as_millisecond();
        let path = dir.join(format!(
            "{millis:013}-{:06}_{}_{}.yaml",
            self.seq % 1_000_000,
            file_safe(recording.namespace.as_deref().unwrap_or("cluster")),
            file_safe(&recording.name)
        ));
        std::fs::write(&path, recording.case.to_yaml()?)
            .with_context(|| format!("writing {}", path.display()))?;
        self.files.push_back(path);
        while self.files.len() > self.max_files {
            if let Some(oldest) = self.files.pop_front()
                && let Err(error) = std::fs::remove_file(&oldest)
                && error.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(file = %oldest.display(), %error, "could not delete an old case");
            }
        }
        Ok(())
    }
}

/// The case files an earlier run left in `dir`, oldest first (their names start with the
/// time they were written).
fn existing_cases(dir: &Path) -> anyhow::Result<VecDeque<PathBuf>> {
    let mut files = Vec::new();
    for policy in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let policy = policy?.path();
        if !policy.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&policy)? {
            let path = file?.path();
            if path.extension().is_some_and(|e| e == "yaml") {
                files.push(path);
            }
        }
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(files.into())
}

/// `text` with anything but letters, digits, `-` and `.` replaced, so a name cannot leave
/// the directory.
fn file_safe(text: &str) -> String {
    let safe: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if safe.starts_with('.') {
        format!("_{safe}")
    } else {
        safe
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn case(n: u64) -> Case {
        Case {
            parent: json!({"metadata": {"name": format!("p{n}")}}),
            children: vec![],
            related: vec![],
            config: None,
            finalizing: false,
            expect: None,
            recorded: None,
        }
    }

    fn files(dir: &Path) -> Vec<PathBuf> {
        existing_cases(dir).expect("list").into()
    }

    /// Wait until the case of parent `name` is written and `count` files are kept.
    fn wait_for(dir: &Path, name: &str, count: usize) {
        let written = |files: &[PathBuf]| {
            files.len() == count
                && files
                    .iter()
                    .any(|p| p.to_string_lossy().ends_with(&format!("_{name}.yaml")))
        };
        for _ in 0..500 {
            if written(&files(dir)) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!(
            "expected {count} files with {name}'s, found {:?}",
            files(dir)
        );
    }

    #[test]
    fn records_readable_cases_and_keeps_only_the_newest() {
        let dir = tempfile::tempdir().expect("temp dir");
        let options = RecordOptions {
            dir: dir.path().to_owned(),
            max_files: 3,
            one_in: 1,
        };
        let recorder = Recorder::start(&options).expect("start");
        for n in 0..5 {
            recorder.record("my/policy", Some("ns"), &format!("p{n}"), case(n));
            // One at a time, so the rotation is deterministic.
            wait_for(dir.path(), &format!("p{n}"), (n as usize + 1).min(3));
        }
        let kept = files(dir.path());
        let parents: Vec<_> = kept
            .iter()
            .map(|p| Case::read(p).expect("a case").parent["metadata"]["name"].clone())
            .collect();
        assert_eq!(
            parents,
            ["p2", "p3", "p4"],
            "the newest three, oldest first"
        );
        assert!(kept[0].parent().expect("dir").ends_with("my_policy"));

        // A new recorder counts what is already there.
        drop(recorder);
        let recorder = Recorder::start(&options).expect("restart");
        recorder.record("my/policy", Some("ns"), "p5", case(5));
        wait_for(dir.path(), "p5", 3);
        assert!(
            !files(dir.path())
                .iter()
                .any(|p| p.to_string_lossy().contains("_p2."))
        );
        assert_eq!(recorder.dropped(), 0);
    }

    #[test]
    fn sampling_records_one_in_n() {
        let dir = tempfile::tempdir().expect("temp dir");
        let recorder = Recorder::start(&RecordOptions {
            dir: dir.path().to_owned(),
            max_files: 100,
            one_in: 3,
        })
        .expect("start");
        let sampled = (0..9).filter(|_| recorder.sample()).count();
        assert_eq!(sampled, 3);
    }

    #[test]
    fn names_cannot_leave_the_directory() {
        assert_eq!(file_safe("../etc"), "_.._etc");
        assert_eq!(file_safe("a/b"), "a_b");
        assert_eq!(file_safe("ok-name.1"), "ok-name.1");
    }
}
