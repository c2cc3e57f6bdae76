//! Guards against a damaged database file giving silently wrong answers
//! (issue 14, fault 1: flipped bytes replayed altered bodies, answered
//! genuine retries with a mismatch, and ran payments twice).
//!
//! A real database file is built through the public API (60 keys:
//! completed with distinct ~300-byte JSON bodies, final failures, UNKNOWN
//! and PROCESSING records, tombstones, outbox messages and an entity) and
//! closed cleanly; every key's answer from the sound file is recorded. Then
//! each trial flips 1–8 random bytes anywhere in a fresh copy of the file,
//! opens an engine on it, calls `begin` for every key with its original
//! fingerprint, and runs `verify`. It must hold that:
//!
//! - no replay differs from the bytes stored (a damaged record is an error
//!   naming its key, never a replay of other bytes);
//! - no mismatch is answered without an error or a problem reported;
//! - in every trial where any answer differs from the sound file's, the
//!   open or a `begin` returned an error, or `verify` reported a problem.
//!
//! Each trial runs in a child process (this test binary, running
//! `flip_trial_in_child_process`), so a panic the engine does not contain
//! (one during unwinding aborts the process) or a hang is reported with the
//! seed, the flipped offsets and the panic's stack, and fails the test.
//!
//! Bytes are flipped in the `.redb` file only: after a clean close the
//! journal beside it holds nothing the file does not.
//!
//! `IDEMPOTENCY_FLIP_TRIALS` sets the number of trials (default 100) and
//! `IDEMPOTENCY_FLIP_SEED` the seed (default: fixed, so the default run is
//! the same every time); the summary line is printed (`--nocapture`).

mod common;
#[path = "common/fixture_engine.rs"]
mod fixture_engine;
#[path = "common/hex.rs"]
mod hex;
#[path = "common/mixed_workload.rs"]
mod mixed_workload;

use std::error::Error;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use fixture_engine::builder;
use hex::hex;
use idempotency::{Begin, Fingerprint, IdempotencyKey, ManualClock};
use mixed_workload::{payment_body, Kind, Workload};

#[path = "common/split_mix.rs"]
mod split_mix;
use split_mix::SplitMix64;

type TestResult = Result<(), Box<dyn Error>>;

/// When the database was written (ms since the Unix epoch).
const T0: u64 = 1_790_000_000_000;
/// Keys in the database.
const KEYS: usize = 60;
/// The seed when `IDEMPOTENCY_FLIP_SEED` is not set: fixed, so the default
/// run is reproducible.
const DEFAULT_SEED: u64 = 0x1de0_7e57_f11b;
/// A trial that takes longer than this is reported as a hang.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(60);

fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("shop:pay", format!("order-{i:03}"))
}

fn fp(i: usize) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(
        format!(
            r#"{{"amount":{},"currency":"EUR","order":{i}}}"#,
            100 + i * 7
        )
        .as_bytes(),
        &[],
    )
}

/// Payment `i`'s JSON body, about 300 bytes.
fn body(i: usize) -> Vec<u8> {
    payment_body(i, 3)
}

/// What key `i`'s record is made to be: completed, failed for good,
/// UNKNOWN, PROCESSING or (among the first 36) a tombstone.
fn kind(i: usize) -> Kind {
    match i % 12 {
        0 => Kind::Declined(format!("declined {i}")),
        1 => Kind::Unknown,
        2 => Kind::Processing,
        3 if i < 36 => Kind::Tombstone,
        5 => Kind::CompletedWithReceipt { json: true },
        _ => Kind::CompletedWithResource(format!("pay_{i:03}")),
    }
}

/// The payments written.
const WORKLOAD: Workload = Workload {
    key,
    fp,
    body,
    kind,
};

/// Writes the database through the public API (the payments, then one
/// entity) and closes it cleanly.
fn build(path: &Path) -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).open(path)?;
    WORKLOAD.write(&engine, &clock, 0..KEYS)?;
    engine.transition("order-1", &[], "created")?;
    engine.transition("order-1", &["created"], "paid")?;
    drop(engine);
    Ok(())
}

/// One key's answer as one exact line of text (what the child process
/// reports): every byte of a replay, every field of the others.
fn describe(b: idempotency::Result<Begin>) -> String {
    match b {
        Ok(Begin::Claimed(_)) => "claimed".into(),
        Ok(Begin::Replay(r)) => {
            let headers: Vec<String> = r
                .envelope
                .headers
                .iter()
                .map(|(name, value)| format!("{name}={}", hex(value)))
                .collect();
            format!(
                "replay status={} schema={} headers={headers:?} body={} resource={:?} kind={:?} \
                 completed_at={} reference={:?} current={} stored_schema={}",
                r.envelope.status,
                r.envelope.schema_version,
                hex(&r.envelope.body),
                r.resource,
                r.kind,
                r.completed_at_ms,
                r.reference,
                r.is_current,
                r.stored_schema_version
            )
        }
        Ok(Begin::Processing { retry_after }) => format!("processing {retry_after:?}"),
        Ok(Begin::Mismatch) => "mismatch".into(),
        Ok(Begin::InDoubt(u)) => format!("unknown {u:?}"),
        Ok(Begin::Tombstoned {
            expired_at_ms,
            reusable_at_ms,
        }) => format!("tombstoned {expired_at_ms} {reusable_at_ms}"),
        Err(e) => format!("error: {e}"),
    }
    .replace('\n', " ")
}

/// Marks the child's report lines among libtest's own output.
const MARK: &str = "FLIP|";
/// Set for the child process: the file it opens.
const CHILD_ENV: &str = "IDEMPOTENCY_FLIP_CHILD_FILE";

/// One trial's work, in a child process started by the test below (see
/// `run_child`): opens the file, asks every key, scrubs, and prints one
/// report line each. Without `IDEMPOTENCY_FLIP_CHILD_FILE` it does nothing.
#[test]
fn flip_trial_in_child_process() -> TestResult {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    // One second after `T0`: leases still run, nothing expired.
    let clock = ManualClock::new(T0);
    clock.advance(Duration::from_secs(1));
    let engine = match builder(&clock).open(&path) {
        Ok(engine) => engine,
        Err(e) => {
            println!("{MARK}open-error {}", e.to_string().replace('\n', " "));
            println!("{MARK}end");
            return Ok(());
        }
    };
    for i in 0..KEYS {
        println!("{MARK}answer {}", describe(engine.begin(&key(i)?, fp(i)?)));
    }
    match engine.verify() {
        Ok(report) => {
            for problem in &report.damage {
                println!("{MARK}problem {}", problem.to_string().replace('\n', " "));
            }
        }
        Err(e) => println!(
            "{MARK}problem verify failed: {}",
            e.to_string().replace('\n', " ")
        ),
    }
    drop(engine);
    println!("{MARK}end");
    Ok(())
}

/// What a child process reported.
#[derive(Debug)]
enum Outcome {
    /// The open failed with an error.
    OpenError(String),
    Answered {
        answers: Vec<String>,
        /// What `verify` reported (or its error).
        problems: Vec<String>,
        /// Panics inside the storage library that the engine contained.
        contained_panics: usize,
    },
    /// The process died (a panic the engine did not contain, or an abort)
    /// or hung: what it printed on stderr.
    Crashed(String),
}

/// Runs `flip_trial_in_child_process` on `path` in a child process (a
/// panic can abort the process when it happens during unwinding, which no
/// `catch_unwind` contains; a child also makes a hang killable).
fn run_child(path: &Path, dir: &Path) -> Result<Outcome, Box<dyn Error>> {
    let out_path = dir.join("child.out");
    let err_path = dir.join("child.err");
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            // `<file>::flip_trial_in_child_process` where this file is a module of a test binary.
            concat!(module_path!(), "::flip_trial_in_child_process")
                .split_once("::")
                .map_or("flip_trial_in_child_process", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, path)
        .env("RUST_BACKTRACE", "1")
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .spawn()?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if started.elapsed() > TRIAL_TIMEOUT {
            // Our own child, by its handle.
            child.kill()?;
            child.wait()?;
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let stdout = std::fs::read_to_string(&out_path)?;
    let stderr = std::fs::read_to_string(&err_path)?;
    let lines: Vec<&str> = stdout
        .lines()
        // libtest may print its "test … " on the same line as the first.
        .filter_map(|l| l.split_once(MARK).map(|(_, line)| line))
        .collect();
    let complete = lines.last() == Some(&"end");
    if !complete || !status.is_some_and(|s| s.success()) {
        let what = match status {
            None => format!("hung (killed after {TRIAL_TIMEOUT:?})"),
            Some(s) => format!("died ({s})"),
        };
        return Ok(Outcome::Crashed(format!(
            "{what}; after {} report lines; stderr:\n{}",
            lines.len(),
            panic_summary(&stderr)
        )));
    }
    if let Some(e) = lines.iter().find_map(|l| l.strip_prefix("open-error ")) {
        return Ok(Outcome::OpenError(e.to_string()));
    }
    Ok(Outcome::Answered {
        answers: lines
            .iter()
            .filter_map(|l| l.strip_prefix("answer "))
            .map(str::to_string)
            .collect(),
        problems: lines
            .iter()
            .filter_map(|l| l.strip_prefix("problem "))
            .map(str::to_string)
            .collect(),
        contained_panics: stderr.matches(" panicked at ").count(),
    })
}

/// The panics in a child's stderr: each message and the frames in redb and
/// in this crate.
fn panic_summary(stderr: &str) -> String {
    let mut out = Vec::new();
    let mut lines = stderr.lines();
    while let Some(line) = lines.next() {
        if line.contains(" panicked at ") {
            out.push(line.to_string());
            if let Some(message) = lines.next() {
                out.push(format!("  {message}"));
            }
        } else if line.contains("redb::") || line.contains("idempotency::") {
            out.push(format!("    {}", line.trim()));
        } else if line.contains("abort") {
            out.push(line.to_string());
        }
    }
    out.join("\n")
}

fn env_u64(name: &str) -> Result<Option<u64>, Box<dyn Error>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v.parse().map_err(|e| format!("{name}={v:?}: {e}"))?)),
        Err(_) => Ok(None),
    }
}

/// A sound database file, and its answers.
struct Sound {
    dir: tempfile::TempDir,
    image: Vec<u8>,
    expected: Vec<String>,
}

impl Sound {
    fn build() -> Result<Sound, Box<dyn Error>> {
        let dir = tempfile::tempdir()?;
        let sound = dir.path().join("sound.redb");
        build(&sound)?;
        let image = std::fs::read(&sound)?;
        let mut sound = Sound {
            dir,
            image,
            expected: Vec::new(),
        };
        // The sound file's answers (on a copy: a `begin` may write).
        let Outcome::Answered {
            answers, problems, ..
        } = sound.run(&sound.image.clone())?
        else {
            return Err("the sound file did not open".into());
        };
        assert!(
            problems.is_empty(),
            "the sound file is not sound: {problems:?}"
        );
        assert_eq!(answers.len(), KEYS);
        for (i, answer) in answers.iter().enumerate() {
            let fits = match kind(i) {
                Kind::Completed
                | Kind::CompletedAfterStep
                | Kind::CompletedWithReceipt { .. }
                | Kind::CompletedWithResource(_)
                | Kind::Declined(_) => answer.starts_with("replay "),
                Kind::Unknown => answer.starts_with("unknown "),
                Kind::Processing => answer.starts_with("processing "),
                Kind::Tombstone => answer.starts_with("tombstoned "),
                // No record under the key: a fresh claim.
                Kind::InboxMark | Kind::Entity { .. } => answer == "claimed",
            };
            assert!(fits, "key {i} ({:?}) answered {answer}", kind(i));
        }
        sound.expected = answers;
        Ok(sound)
    }

    /// Runs a trial on `bytes` as the database file. Only the `.redb` file
    /// is copied: a clean close leaves everything in it, and the engine
    /// creates a missing journal (`<file>.journal`) on open. The previous
    /// trial's journal is removed first: it carries the same journal id
    /// (copied in the file's meta table), so its frames would be applied.
    fn run(&self, bytes: &[u8]) -> Result<Outcome, Box<dyn Error>> {
        let path = self.dir.path().join("trial.redb");
        let journal = self.dir.path().join("trial.redb.journal");
        match std::fs::remove_file(&journal) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        std::fs::write(&path, bytes)?;
        run_child(&path, self.dir.path())
    }
}

/// What one trial's answers and problems say.
struct Judged {
    request_errors: usize,
    problems: usize,
    /// Answers (not errors) that differ from the sound file's.
    differ: usize,
    /// What broke the rules (empty: the trial passed).
    wrong: Vec<String>,
}

fn judge(expected: &[String], answers: &[String], problems: &[String]) -> Judged {
    let request_errors = answers.iter().filter(|a| a.starts_with("error")).count();
    let detected = request_errors > 0 || !problems.is_empty();
    let mut wrong = Vec::new();
    let mut differ = 0;
    if answers.len() != KEYS {
        wrong.push(format!("{} answers for {KEYS} keys", answers.len()));
    }
    for (i, (got, sound)) in answers.iter().zip(expected).enumerate() {
        if got.starts_with("error") || got == sound {
            continue;
        }
        differ += 1;
        if got.starts_with("replay ") {
            // Detected or not: never a replay of other bytes.
            wrong.push(format!("key {i}: replayed {got} instead of {sound}"));
        } else if !detected {
            wrong.push(format!("key {i}: {got} instead of {sound}"));
        }
    }
    Judged {
        request_errors,
        problems: problems.len(),
        differ,
        wrong,
    }
}

#[test]
fn flipped_bytes_never_give_a_silently_wrong_answer() -> TestResult {
    let trials = env_u64("IDEMPOTENCY_FLIP_TRIALS")?.unwrap_or(100);
    let seed = env_u64("IDEMPOTENCY_FLIP_SEED")?.unwrap_or(DEFAULT_SEED);
    println!("byte flips: seed {seed} (IDEMPOTENCY_FLIP_SEED), {trials} trials");
    let sound = Sound::build()?;

    let mut rng = SplitMix64(seed);
    let mut counts = Counts::default();
    let mut failures = Vec::new();
    for trial in 0..trials {
        let mut bytes = sound.image.clone();
        let flips = 1 + rng.below(8);
        let mut offsets = Vec::new();
        for _ in 0..flips {
            let at = usize::try_from(rng.below(u64::try_from(bytes.len())?))?;
            let mask = u8::try_from(1 + rng.below(255))?;
            bytes[at] ^= mask;
            offsets.push((at, mask));
        }
        let what = format!("trial {trial} (seed {seed}), flips (offset, xor mask) {offsets:?}");
        let (answers, problems) = match sound.run(&bytes)? {
            Outcome::OpenError(e) => {
                counts.clean_errors += 1;
                *counts.open_errors.entry(error_kind(&e)).or_default() += 1;
                continue;
            }
            Outcome::Crashed(report) => {
                counts.crashed += 1;
                failures.push(format!("{what}: {report}"));
                continue;
            }
            Outcome::Answered {
                answers,
                problems,
                contained_panics,
            } => {
                counts.contained_panics += contained_panics;
                (answers, problems)
            }
        };
        let j = judge(&sound.expected, &answers, &problems);
        if j.request_errors > 0 {
            counts.at_request += 1;
        }
        if j.problems > 0 {
            counts.by_verify += 1;
        }
        if j.request_errors == 0 && j.problems == 0 && j.differ == 0 {
            counts.no_effect += 1;
        }
        if !j.wrong.is_empty() {
            counts.silently_wrong += 1;
            failures.push(format!(
                "{what}: silently wrong ({} request errors, verify {problems:?}): {}",
                j.request_errors,
                j.wrong.join("; ")
            ));
        }
    }
    println!(
        "byte flips: {trials} trials, {} detected at request time, {} detected by verify, \
         {} clean errors (open refused), {} silently wrong, {} without effect (no answer \
         changed, nothing reported), {} crashed or hung (a panic not contained), {} storage \
         library panics contained",
        counts.at_request,
        counts.by_verify,
        counts.clean_errors,
        counts.silently_wrong,
        counts.no_effect,
        counts.crashed,
        counts.contained_panics
    );
    println!("byte flips: open errors by kind: {:?}", counts.open_errors);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    Ok(())
}

/// A damaged key in a page of the records table's tree (a separator in a
/// branch page, or a key in a leaf) can send a lookup of a *sound* record
/// astray: the request finds no record and would run the work again, while
/// a walk of the table still meets every record, each decoding and passing
/// its checksum. The random trials above found this; here every stored
/// copy of every record key is damaged in turn (its last byte made `~`),
/// so the case is met whatever the file's layout. Each attempt must keep
/// the rules, and some attempt must misroute a lookup and be reported by
/// `verify` as an unreachable record.
#[test]
fn a_damaged_key_in_the_records_tree_is_found_by_verify() -> TestResult {
    let sound = Sound::build()?;
    let mut failures = Vec::new();
    let mut misrouted_and_reported = 0;
    let (mut attempts, mut refused_at_open, mut no_effect) = (0, 0, 0);
    for i in 0..KEYS {
        let k = key(i)?;
        let rkey = [
            &[u8::try_from(k.scope().len())?][..],
            k.scope().as_bytes(),
            k.key().as_bytes(),
        ]
        .concat();
        let at: Vec<usize> = sound
            .image
            .windows(rkey.len())
            .enumerate()
            .filter(|(_, w)| *w == rkey.as_slice())
            .map(|(at, _)| at + rkey.len() - 1)
            .collect();
        for at in at {
            let mut bytes = sound.image.clone();
            bytes[at] = b'~';
            attempts += 1;
            let (answers, problems) = match sound.run(&bytes)? {
                Outcome::Answered {
                    answers, problems, ..
                } => (answers, problems),
                Outcome::OpenError(_) => {
                    refused_at_open += 1;
                    continue;
                }
                Outcome::Crashed(report) => {
                    failures.push(format!("key {i}, byte {at}: {report}"));
                    continue;
                }
            };
            let j = judge(&sound.expected, &answers, &problems);
            if !j.wrong.is_empty() {
                failures.push(format!("key {i}, byte {at}: {}", j.wrong.join("; ")));
            }
            if j.differ == 0 && j.request_errors == 0 && j.problems == 0 {
                // A stale copy of the key in a page no tree uses any more
                // (an older version of a leaf): nothing reads it.
                no_effect += 1;
                continue;
            }
            let unreachable = problems
                .iter()
                .any(|p| p.contains("a lookup of its key does not find it"));
            if j.differ > 0 && unreachable {
                misrouted_and_reported += 1;
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // A writable open verifies every page's checksum first (redb's
    // integrity check), so a damaged key in a page in use is normally
    // refused there; a file that opens must have its misrouted lookups
    // reported by `verify`.
    assert!(attempts > no_effect, "no stored key found in a page in use");
    assert!(
        misrouted_and_reported > 0 || refused_at_open + no_effect == attempts,
        "a damaged key neither refused at open nor reported: {attempts} attempts, \
         {refused_at_open} refused at open, {no_effect} in unused pages, \
         {misrouted_and_reported} misrouted and reported"
    );
    Ok(())
}

/// Trials by what happened in them (a trial may count in both `at_request`
/// and `by_verify`).
#[derive(Default)]
struct Counts {
    at_request: u64,
    by_verify: u64,
    clean_errors: u64,
    silently_wrong: u64,
    no_effect: u64,
    crashed: u64,
    contained_panics: usize,
    /// Open errors by their text up to the first colon or parenthesis.
    open_errors: std::collections::BTreeMap<String, u64>,
}

/// An open error's text without the path and details, for counting kinds.
fn error_kind(e: &str) -> String {
    let e = e.split_once(": ").map_or(e, |(_, rest)| rest);
    e.chars().take(60).collect()
}
