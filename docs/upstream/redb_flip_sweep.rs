//! The byte-flip sweep behind docs/upstream/redb-panics.md (a document, not built by this
//! workspace). A standalone cargo project with `redb = "=4.6.0"`, this file as src/main.rs.
//!
//!   N=1 NOSTR=1 ./sweep.sh OUT 01,02,04,08,10,20,40,80,ff   # config 1b
//!   N=1 ./sweep.sh OUT ...; N=300 ./sweep.sh OUT ...; CHECK=1 N=300 ./sweep.sh OUT ...
//!   ./redb-repro one OFFSET XORHEX   (BT=1 for a backtrace of each panic)
//!
//! sweep.sh runs `redb-repro child START END MASKS` (trial index = offset * masks + mask index)
//! and, when the child aborts, records `ABORT` after the last `TRY` line and resumes after it:
//!
//!     #!/bin/bash
//!     # usage: sweep.sh OUT MASKS [START_IDX END_IDX]   (env N, NOSTR passed through)
//!     out=$1; masks=$2; cur=${3:-0}; end=${4:-999999999}
//!     : > $out; : > $out.err
//!     while true; do
//!       ./target/release/redb-repro child $cur $end $masks >> $out 2>> $out.err
//!       rc=$?
//!       if [ $rc -eq 0 ]; then break; fi
//!       last=$(grep -a '^TRY' $out | tail -1)
//!       echo "ABORT rc=$rc after $last" >> $out
//!       echo "ABORT rc=$rc after $last" >> $out.err
//!       idx=$(echo "$last" | awk '{print $2}')
//!       [ -z "$idx" ] && { echo "driver: cannot parse"; exit 1; }
//!       cur=$((idx+1))
//!     done

use redb::{Database, ReadableDatabase, ReadableTable, StorageBackend, TableDefinition};
use std::sync::RwLock;

const BYTES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("bytes");
const STRS: TableDefinition<&str, &[u8]> = TableDefinition::new("strs");

#[derive(Debug)]
struct Mem(std::sync::Arc<RwLock<Vec<u8>>>);
impl StorageBackend for Mem {
    fn len(&self) -> std::io::Result<u64> { Ok(self.0.read().unwrap().len() as u64) }
    fn read(&self, off: u64, out: &mut [u8]) -> std::io::Result<()> {
        let d = self.0.read().unwrap();
        let o = off as usize;
        if o + out.len() > d.len() { return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "oob")); }
        out.copy_from_slice(&d[o..o + out.len()]);
        Ok(())
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> { self.0.write().unwrap().resize(len as usize, 0); Ok(()) }
    fn sync_data(&self) -> std::io::Result<()> { Ok(()) }
    fn write(&self, off: u64, data: &[u8]) -> std::io::Result<()> {
        let mut d = self.0.write().unwrap();
        let o = off as usize;
        if o + data.len() > d.len() { d.resize(o + data.len(), 0); }
        d[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
}

fn build(n: usize, str_table: bool) -> Vec<u8> {
    let path = "/dev/shm/redb-repro-base.redb";
    let _ = std::fs::remove_file(path);
    {
        let db = Database::create(path).unwrap();
        let tx = db.begin_write().unwrap();
        {
            let mut t = tx.open_table(BYTES).unwrap();
            for i in 0..n {
                let k = format!("key-{i:05}");
                let v = format!("value-{i:05}-{}", "x".repeat(i % 17));
                t.insert(k.as_bytes(), v.as_bytes()).unwrap();
            }
        }
        if str_table {
            let mut t = tx.open_table(STRS).unwrap();
            for i in 0..n {
                let k = format!("s{i:05}");
                t.insert(k.as_str(), &[i as u8; 8][..]).unwrap();
            }
        }
        tx.commit().unwrap();
    }
    let b = std::fs::read(path).unwrap();
    let _ = std::fs::remove_file(path);
    b
}

thread_local! { static LAST: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) }; }

fn msg(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() { s.to_string() } else if let Some(s) = p.downcast_ref::<String>() { s.clone() } else { "?".into() }
}

/// Runs one step; returns "ok", "err: ..." or "PANIC file:line: msg".
fn step<T>(f: impl FnOnce() -> Result<T, String>) -> (Option<T>, String) {
    LAST.with(|l| *l.borrow_mut() = None);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => (Some(v), "ok".into()),
        Ok(Err(e)) => (None, format!("err: {e}")),
        Err(p) => {
            let loc = LAST.with(|l| l.borrow_mut().take()).unwrap_or_default();
            (None, format!("PANIC {loc} :: {}", msg(p.as_ref()).replace('\n', " ")))
        }
    }
}

fn read_all(db: &Database, str_table: bool) -> Result<usize, String> {
    let tx = db.begin_read().map_err(|e| e.to_string())?;
    let mut n = 0;
    let t = tx.open_table(BYTES).map_err(|e| e.to_string())?;
    for e in t.iter().map_err(|e| e.to_string())? {
        let (k, v) = e.map_err(|e| e.to_string())?;
        n += k.value().len() + v.value().len();
    }
    if str_table {
        let t = tx.open_table(STRS).map_err(|e| e.to_string())?;
        for e in t.iter().map_err(|e| e.to_string())? {
            let (k, v) = e.map_err(|e| e.to_string())?;
            n += k.value().len() + v.value().len();
        }
    }
    Ok(n)
}

fn write_some(db: &Database, str_table: bool, tag: &str) -> Result<(), String> {
    let mut tx = db.begin_write().map_err(|e| e.to_string())?;
    let nondurable = std::env::var("NONDURABLE").is_ok();
    if nondurable { tx.set_durability(redb::Durability::None).map_err(|e| e.to_string())?; }
    {
        let mut t = tx.open_table(BYTES).map_err(|e| e.to_string())?;
        for i in 0..20 {
            let k = format!("new-{tag}-{i}");
            t.insert(k.as_bytes(), &b"some new value"[..]).map_err(|e| e.to_string())?;
        }
    }
    if str_table {
        let mut t = tx.open_table(STRS).map_err(|e| e.to_string())?;
        t.insert("snew", &b"v"[..]).map_err(|e| e.to_string())?;
    }
    tx.commit().map_err(|e| e.to_string())?;
    if nondurable {
        let mut tx = db.begin_write().map_err(|e| e.to_string())?;
        tx.set_durability(redb::Durability::Immediate).map_err(|e| e.to_string())?;
        tx.open_table(BYTES).map_err(|e| e.to_string())?.insert(&b"checkpoint"[..], &b"x"[..]).map_err(|e| e.to_string())?;
        tx.commit().map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// One corrupted copy: returns the step log.
fn trial(bytes: Vec<u8>, str_table: bool) -> Vec<String> {
    let mut log = vec![];
    let shared = std::sync::Arc::new(RwLock::new(bytes));
    let check = std::env::var("CHECK").is_ok();
    let (db, r) = step(|| Database::builder().set_check_integrity_on_open(check).create_with_backend(Mem(shared.clone())).map_err(|e| e.to_string()));
    log.push(format!("open={r}"));
    let Some(db) = db else { return log };
    let (_, r) = step(|| read_all(&db, str_table));
    log.push(format!("read={r}"));
    let (_, r) = step(|| write_some(&db, str_table, "a"));
    log.push(format!("write={r}"));
    if log.iter().any(|l| l.contains("PANIC")) {
        let (_, r) = step(|| write_some(&db, str_table, "b"));
        log.push(format!("write2={r}"));
        let (_, r) = step(|| read_all(&db, str_table));
        log.push(format!("read2={r}"));
    }
    let (_, r) = step(move || { drop(db); Ok(()) });
    log.push(format!("drop={r}"));
    if log.iter().any(|l| (l.starts_with("write") || l.starts_with("drop")) && l.contains("PANIC")) {
        let after = shared.read().unwrap_or_else(|e| e.into_inner()).clone();
        let (db, r) = step(|| Database::builder().create_with_backend(Mem(std::sync::Arc::new(RwLock::new(after)))).map_err(|e| e.to_string()));
        log.push(format!("reopen={r}"));
        if let Some(db) = db {
            let (_, r) = step(|| read_all(&db, str_table));
            log.push(format!("reread={r}"));
            let _ = step(move || { drop(db); Ok(()) });
        }
    }
    log
}

fn hook() {
    let want_bt = std::env::var("BT").is_ok();
    std::panic::set_hook(Box::new(move |info| {
        let loc = info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column())).unwrap_or_default();
        if want_bt {
            eprintln!("---- panic at {loc}: {}", info.payload().downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| info.payload().downcast_ref::<String>().cloned()).unwrap_or_default());
            eprintln!("{}", std::backtrace::Backtrace::force_capture());
        }
        LAST.with(|l| *l.borrow_mut() = Some(loc));
    }));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    hook();
    let n: usize = std::env::var("N").ok().map(|s| s.parse().unwrap()).unwrap_or(300);
    let str_table = std::env::var("NOSTR").is_err();
    let base = build(n, str_table);
    match args.get(1).map(|s| s.as_str()) {
        Some("size") => {
            println!("len {}", base.len());
            let nz: Vec<usize> = (0..base.len()).filter(|&i| base[i] != 0).collect();
            println!("nonzero {}", nz.len());
            // nonzero 4k pages
            let mut pages: Vec<usize> = nz.iter().map(|i| i / 4096).collect();
            pages.dedup();
            println!("pages {:?}", pages);
            std::fs::write("/tmp/redb-repro/base.redb", &base).unwrap();
            println!("clean: {:?}", trial(base.clone(), str_table));
        }
        Some("child") => {
            // child START_IDX END_IDX MASKS: trial index = offset * masks.len() + mask index
            let masks: Vec<u8> = args[4].split(',').map(|m| u8::from_str_radix(m, 16).unwrap()).collect();
            let start: usize = args[2].parse().unwrap();
            let end: usize = args[3].parse::<usize>().unwrap().min(base.len() * masks.len());
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            for idx in start..end {
                let (off, m) = (idx / masks.len(), masks[idx % masks.len()]);
                let mut b = base.clone();
                b[off] ^= m;
                let nb = b[off];
                writeln!(out, "TRY {idx} {off} {m:02x}").unwrap();
                out.flush().unwrap();
                let log = trial(b, str_table);
                writeln!(out, "RES {off} {m:02x} {nb:02x} {}", log.join(" | ")).unwrap();
            }
        }
        Some("one") => {
            let off: usize = args[2].parse().unwrap();
            let m = u8::from_str_radix(&args[3], 16).unwrap();
            let mut b = base.clone();
            b[off] ^= m;
            println!("len {} off {off} old {:02x} new {:02x}", base.len(), base[off], b[off]);
            for l in trial(b, str_table) { println!("{l}"); }
        }
        _ => eprintln!("usage"),
    }
}
