//! Running a docs walk-through as written: its `sh` setup block and its `console` blocks,
//! each `$ command` run by bash and its output compared, by shape, with what the page shows.
//!
//! Shape, because a real session prints its own digests, times and counts: both sides have
//! timestamps, hex digests and numbers replaced by placeholders and runs of spaces collapsed
//! before they are compared. On the page, `…` inside a line stands for any text, and a line
//! that is only `…` for any number of lines (output trimmed where marked). Everything else
//! must match, line for line.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use regex::Regex;

/// One `$ command` of a console block and the lines the page shows it printing.
#[derive(Debug)]
pub struct Step {
    pub command: String,
    pub expected: Vec<String>,
}

/// The fenced blocks of `lang` in the section of `markdown` under the line `heading`, up to
/// the next heading of the same or a higher level.
pub fn blocks(markdown: &str, heading: &str, lang: &str) -> Vec<String> {
    let level = heading.split(' ').next().unwrap_or("#");
    let Some((_, section)) = markdown.split_once(&format!("\n{heading}\n")) else {
        panic!("no section {heading:?}");
    };
    // The next heading outside a fenced block (a shell comment in one is not a heading).
    let mut fenced = false;
    let mut offset = 0;
    let mut end = section.len();
    for line in section.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !fenced && hashes > 0 && hashes <= level.len() && line[hashes..].starts_with(' ') {
            end = offset;
            break;
        }
        offset += line.len() + 1;
    }
    let mut found = Vec::new();
    let mut rest = &section[..end];
    let fence = format!("```{lang}\n");
    while let Some((_, after)) = rest.split_once(fence.as_str()) {
        let (block, after) = after.split_once("\n```").expect("an unclosed block");
        found.push(block.to_owned());
        rest = after;
    }
    found
}

/// The steps of a console block. A command goes on over the next lines while its line ends
/// in `\` or leaves a single quote open.
pub fn steps(block: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut open = false;
    for line in block.lines() {
        if open {
            let step = steps.last_mut().expect("a command");
            step.command.push('\n');
            step.command.push_str(line);
            open = continues(&step.command);
        } else if let Some(command) = line.strip_prefix("$ ") {
            steps.push(Step {
                command: command.to_owned(),
                expected: Vec::new(),
            });
            open = continues(command);
        } else if let Some(step) = steps.last_mut() {
            step.expected.push(line.to_owned());
        }
    }
    steps
}

/// Whether `command` goes on past its last line: it ends in `\` or leaves a quote open (a
/// quote in a `#` comment, as in "MyApp's", opens nothing).
fn continues(command: &str) -> bool {
    let (mut single, mut double) = (false, false);
    for line in command.lines() {
        let mut after_space = true;
        for c in line.chars() {
            match c {
                '\'' if !double => single = !single,
                '"' if !single => double = !double,
                '#' if !single && !double && after_space => break,
                _ => {}
            }
            after_space = c.is_whitespace();
        }
    }
    command.ends_with('\\') || single || double
}

/// `line` with what differs between sessions replaced by placeholders.
fn normalized(line: &str) -> String {
    static PATTERNS: OnceLock<Vec<(Regex, &'static str)>> = OnceLock::new();
    let patterns = PATTERNS.get_or_init(|| {
        [
            (r"\d{4}-\d{2}-\d{2}T[0-9:.]+Z", "TIME"),
            (r"sha256:[0-9a-f]+", "sha256:HEX"),
            (r"\b[0-9a-f]{7,}\b", "HEX"),
            // Ages as kubectl prints them: 15s, 2m3s, 4h.
            (r"\b(\d+[dhms])+\b", "AGE"),
            (r"\s+", " "),
        ]
        .into_iter()
        .map(|(pattern, with)| (Regex::new(pattern).expect("a pattern"), with))
        .collect()
    });
    static NUMBER: OnceLock<Regex> = OnceLock::new();
    let number = NUMBER.get_or_init(|| Regex::new(r"\d+(\.\d+)?").expect("a pattern"));
    let mut line = line.trim().to_owned();
    for (pattern, with) in patterns {
        line = pattern.replace_all(&line, *with).into_owned();
    }
    // Any number stands for any other, except that none is none: "0 would fail" and an
    // exit status of 0 must be so in the session too.
    number
        .replace_all(
            &line,
            |found: &regex::Captures<'_>| {
                if &found[0] == "0" { "0" } else { "N" }
            },
        )
        .into_owned()
}

/// Whether `actual` has the shape `expected` shows.
pub fn same_shape(expected: &[String], actual: &[String]) -> bool {
    let expected: Vec<String> = expected.iter().map(|l| normalized(l)).collect();
    let actual: Vec<String> = actual.iter().map(|l| normalized(l)).collect();
    matches_from(&expected, &actual)
}

fn matches_from(expected: &[String], actual: &[String]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((first, rest)) if first == "…" => {
            (0..=actual.len()).any(|skip| matches_from(rest, &actual[skip..]))
        }
        Some((first, rest)) => actual
            .split_first()
            .is_some_and(|(line, more)| line_matches(first, line) && matches_from(rest, more)),
    }
}

/// `…` inside a line stands for any text.
fn line_matches(expected: &str, actual: &str) -> bool {
    let mut parts = expected.split('…');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = actual.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

/// The longest one command may run (a first `cargo run` builds): a command still running
/// then is one the page should not have shown.
const COMMAND_LIMIT: Duration = Duration::from_secs(600);

/// What a finished command printed after itself: its status follows.
const DONE: &str = "__walkthrough_done__";

/// One shell for a whole page, as a reader's terminal is: `cd`, variables and `$?` carry
/// from one command to the next.
pub struct Session {
    /// Each reader's own values: (as the page has it, as this session has it).
    values: Vec<(String, String)>,
    shell: std::process::Child,
    input: std::process::ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Session {
    /// A bash in `dir`, with `env` added to the test's environment (stderr goes where stdout
    /// does, as on a terminal).
    pub fn new(dir: &Path, env: Vec<(String, String)>, values: Vec<(String, String)>) -> Self {
        let mut shell = Command::new("bash");
        // What builds in the session (`cargo run`) must not see the test's own package
        // variables, or it rebuilds what the suite built (ring's build script reruns).
        wasmctrl_testenv::runner::without_cargos_package_variables(&mut shell);
        let mut shell = shell
            .args(["--noprofile", "--norc"])
            .current_dir(dir)
            .envs(env)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting bash");
        let mut input = shell.stdin.take().expect("stdin");
        let output = shell.stdout.take().expect("stdout");
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(output).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        use std::io::Write as _;
        writeln!(input, "exec 2>&1").expect("bash's stdin");
        Self {
            values,
            shell,
            input,
            lines,
        }
    }

    /// `text` with the page's values replaced by this session's.
    pub fn fill(&self, text: &str) -> String {
        self.values
            .iter()
            .fold(text.to_owned(), |text, (page, ours)| {
                text.replace(page, ours)
            })
    }

    /// Run `command` (after filling in the values), waiting at most `limit`: its status and
    /// what it printed.
    pub fn run(&mut self, command: &str, limit: Duration) -> (i32, String) {
        use std::io::Write as _;
        if command.trim_start().starts_with('#') {
            // A remark on the page (`# 30 seconds later`): nothing runs, `$?` stays.
            return (0, String::new());
        }
        // In braces (this shell, so `cd` and variables carry) reading nothing: a command
        // that reads its stdin must not take the rest of the script.
        let script = format!(
            "{{ {}\n}} </dev/null\n__status=$?; printf '\\n{DONE} %d\\n' \"$__status\"; (exit \"$__status\")\n",
            self.fill(command)
        );
        self.input
            .write_all(script.as_bytes())
            .and_then(|()| self.input.flush())
            .expect("bash's stdin");
        let deadline = Instant::now() + limit;
        let mut printed = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(line) => line,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("$ {command}\nstill running after {limit:?}; printed so far:\n{printed}")
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("$ {command}\nended the shell; it printed:\n{printed}")
                }
            };
            if let Some(status) = line.strip_prefix(DONE) {
                // The marker starts on a line of its own: drop the newline put before it
                // (which ends an output that lacked its own, and is then kept).
                if printed.ends_with("\n\n") || printed == "\n" {
                    printed.pop();
                }
                let status = status.trim().parse().unwrap_or(-1);
                return (status, printed);
            }
            printed.push_str(&line);
            printed.push('\n');
        }
    }

    /// Run each command of a setup block; each must succeed.
    pub fn set_up(&mut self, block: &str) {
        for step in steps(&prompted(block)) {
            let (status, output) = self.run(&step.command, COMMAND_LIMIT);
            assert_eq!(status, 0, "$ {}\n{output}", self.fill(&step.command));
        }
    }

    /// Run each step of a console block in order: it must print what the page shows, by
    /// shape, and succeed unless the page's next step is `echo $?`. A step that only reads
    /// (see [`rereadable`]) is run again until it does, as a reader waits for a rollout or a
    /// reconcile, or until `patience` runs out; any other runs once. What each step that
    /// never did printed, and what the page shows instead.
    pub fn play(&mut self, block: &str, patience: Duration) -> Vec<String> {
        let mut failures = Vec::new();
        let steps = steps(block);
        for (at, step) in steps.iter().enumerate() {
            let may_fail = steps
                .get(at + 1)
                .is_some_and(|next| next.command.trim() == "echo $?");
            let expected: Vec<String> = step.expected.iter().map(|l| self.fill(l)).collect();
            let started = Instant::now();
            loop {
                let (status, output) = self.run(&step.command, COMMAND_LIMIT);
                let lines: Vec<String> = output.lines().map(str::to_owned).collect();
                let shaped = same_shape(&expected, &lines);
                if shaped && (status == 0 || may_fail) {
                    break;
                }
                if !rereadable(&step.command) || started.elapsed() >= patience {
                    let failed = if shaped { "failed" } else { "printed" };
                    failures.push(format!(
                        "$ {}\n{failed} (status {status}):\n{output}\nthe page shows:\n{}",
                        self.fill(&step.command),
                        expected.join("\n")
                    ));
                    break;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        failures
    }
}

/// Whether `command` only reads, so running it again changes nothing: the commands a
/// reader repeats while waiting.
fn rereadable(command: &str) -> bool {
    [
        "kubectl get ",
        "wasmctrl explain ",
        "wasmctrl rollout status ",
        "curl ",
        "cargo run -q -p wasmctrl -- explain ",
    ]
    .iter()
    .any(|reader| command.starts_with(reader))
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.shell.kill();
        let _ = self.shell.wait();
    }
}

/// A setup block's lines as console commands (`$ ` before each that does not continue the
/// one before).
fn prompted(block: &str) -> String {
    let mut out = String::new();
    let mut command = String::new();
    for line in block.lines() {
        if command.is_empty() {
            out.push_str("$ ");
        } else {
            command.push('\n');
        }
        command.push_str(line);
        out.push_str(line);
        out.push('\n');
        if !continues(&command) {
            command.clear();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_owned).collect()
    }

    #[test]
    fn shapes_ignore_digests_times_numbers_and_spacing_but_not_words() {
        assert!(same_shape(
            &lines("shop   2          2/2     15s"),
            &lines("shop 3 3/3   2m5s")
        ));
        assert!(same_shape(
            &lines("plugin: sha256:4c153f reconciled at 2026-11-30T22:06:42.661Z"),
            &lines("plugin: sha256:0cac4d reconciled at 2026-12-05T01:02:03Z")
        ));
        assert!(!same_shape(
            &lines("unchanged  Deployment shop"),
            &lines("changed Deployment shop")
        ));
        assert!(!same_shape(&lines("a\nb"), &lines("a")));
        assert!(!same_shape(&lines("0 would fail"), &lines("5 would fail")));
        assert!(!same_shape(&lines("1"), &lines("0")));
        assert!(same_shape(
            &lines("at most 0.0% of 22"),
            &lines("at most 5.0% of 9")
        ));
    }

    #[test]
    fn an_ellipsis_stands_for_text_in_a_line_and_for_lines_alone() {
        assert!(same_shape(&lines("x: {…} end"), &lines("x: {\"a\":1} end")));
        assert!(!same_shape(
            &lines("x: {…} end"),
            &lines("x: {\"a\":1} more")
        ));
        assert!(same_shape(&lines("a\n  …\nz"), &lines("a\nb\nc\nz")));
        assert!(same_shape(&lines("a\n  …\nz"), &lines("a\nz")));
        assert!(!same_shape(&lines("a\n…\nz"), &lines("a\nb")));
    }

    #[test]
    fn a_command_goes_on_past_a_backslash_and_an_open_quote() {
        let steps = steps(
            "$ kubectl patch x \\\n    -p '{\n  \"a\": 1}'\npatched\n$ echo $? # it's 1\n1\n$ true",
        );
        assert_eq!(steps.len(), 3);
        assert_eq!(
            steps[0].command,
            "kubectl patch x \\\n    -p '{\n  \"a\": 1}'"
        );
        assert_eq!(steps[0].expected, ["patched"]);
        assert_eq!(steps[1].expected, ["1"]);
    }
}
