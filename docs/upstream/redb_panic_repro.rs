//! redb 4.6.0 panics (and aborts) instead of returning `Err(StorageError::Corrupted(..))`
//! when a database file has one corrupted byte.
//!
//! Drop this file into redb's `examples/` folder (it only needs the `redb` crate) and run
//!
//! ```text
//! cargo run --release --example redb_panic_repro               # every case, each in its own process
//! cargo run --release --example redb_panic_repro -- bitmap_315 # one case (RUST_BACKTRACE=1 for a stack)
//! ```
//!
//! Every case does the same thing:
//! 1. create a fresh database file and, in one write transaction, insert `entries` pairs into the
//!    table `bytes: &[u8] -> &[u8]` (and, if `str_table`, into `strs: &str -> &[u8]`); commit; drop
//!    the `Database` (clean close). The file is always 73728 bytes and deterministic: its FNV-1a
//!    hash is printed and checked, so the offset below points at the same byte on every machine;
//! 2. XOR one byte of the file at `offset` with `xor`;
//! 3. `Database::open`, read every table to the end (`iter()`), then one write transaction that
//!    inserts 20 pairs into `bytes` (and one into `strs`) and commits; after a panic, a second write
//!    transaction and a second read on the same `Database`; drop the `Database`; after a panic in a
//!    write or in drop, open the file again and read it.
//!
//! Each step runs under `catch_unwind` so that later steps show what a caller who contains the
//! panic sees next. Every step should return `Err(..)` (ideally `StorageError::Corrupted`); none
//! should panic, and none should abort the process.
//!
//! With `Builder::set_check_integrity_on_open(true)` every one of these files fails to open with
//! `Err(Corrupted)` instead (run with `CHECK=1` to see that).

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

const BYTES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("bytes");
const STRS: TableDefinition<&str, &[u8]> = TableDefinition::new("strs");

struct Case {
    name: &'static str,
    /// Where redb 4.6.0 panics first for this file.
    site: &'static str,
    entries: usize,
    str_table: bool,
    offset: usize,
    xor: u8,
}

// CASES_BEGIN
const CASES: &[Case] = &[
    Case { name: "btree_cursor_167", site: "src/tree_store/btree_cursor.rs:167", entries: 1, str_table: false, offset: 16384, xor: 0x01 },
    Case { name: "btree_iters_35", site: "src/tree_store/btree_iters.rs:35", entries: 1, str_table: false, offset: 4098, xor: 0x02 },
    Case { name: "btree_base_686", site: "src/tree_store/btree_base.rs:686", entries: 1, str_table: false, offset: 12290, xor: 0x02 },
    Case { name: "btree_base_690", site: "src/tree_store/btree_base.rs:690", entries: 1, str_table: false, offset: 69634, xor: 0x20 },
    Case { name: "btree_base_665", site: "src/tree_store/btree_base.rs:665", entries: 1, str_table: false, offset: 69635, xor: 0x02 },
    Case { name: "btree_cursor_233", site: "src/tree_store/btree_cursor.rs:233", entries: 1, str_table: false, offset: 4099, xor: 0x04 },
    Case { name: "btree_base_691", site: "src/tree_store/btree_base.rs:691", entries: 1, str_table: false, offset: 4100, xor: 0x20 },
    Case { name: "btree_base_283", site: "src/tree_store/btree_base.rs:283", entries: 1, str_table: false, offset: 12305, xor: 0x10 },
    Case { name: "btree_1110", site: "src/tree_store/btree.rs:1110", entries: 1, str_table: false, offset: 12288, xor: 0x01 },
    Case { name: "btree_mutator_1203", site: "src/tree_store/btree_mutator.rs:1203", entries: 1, str_table: false, offset: 12300, xor: 0x04 },
    Case { name: "table_tree_base_48", site: "src/tree_store/table_tree_base.rs:48", entries: 1, str_table: false, offset: 12304, xor: 0x01 },
    Case { name: "table_tree_base_370", site: "src/tree_store/table_tree_base.rs:370", entries: 1, str_table: false, offset: 12304, xor: 0x80 },
    Case { name: "table_tree_base_441", site: "src/tree_store/table_tree_base.rs:441", entries: 1, str_table: false, offset: 12308, xor: 0x10 },
    Case { name: "table_tree_base_386", site: "src/tree_store/table_tree_base.rs:386", entries: 1, str_table: false, offset: 12308, xor: 0x40 },
    Case { name: "types_109", site: "src/types.rs:109", entries: 1, str_table: false, offset: 12309, xor: 0x01 },
    Case { name: "table_tree_base_376", site: "src/tree_store/table_tree_base.rs:376", entries: 1, str_table: false, offset: 12316, xor: 0xff },
    Case { name: "table_tree_362", site: "src/tree_store/table_tree.rs:362", entries: 1, str_table: false, offset: 12339, xor: 0x01 },
    Case { name: "table_tree_base_371", site: "src/tree_store/table_tree_base.rs:371", entries: 1, str_table: false, offset: 12405, xor: 0x01 },
    Case { name: "types_47", site: "src/types.rs:47", entries: 1, str_table: false, offset: 12465, xor: 0x01 },
    Case { name: "transactions_233", site: "src/transactions.rs:233", entries: 1, str_table: false, offset: 16386, xor: 0x02 },
    Case { name: "btree_iters_47", site: "src/tree_store/btree_iters.rs:47", entries: 1, str_table: false, offset: 16389, xor: 0x10 },
    Case { name: "bitmap_376", site: "src/tree_store/page_store/bitmap.rs:376", entries: 1, str_table: false, offset: 16509, xor: 0x01 },
    Case { name: "bitmap_315", site: "src/tree_store/page_store/bitmap.rs:315", entries: 1, str_table: false, offset: 16513, xor: 0x02 },
    Case { name: "bitmap_53", site: "src/tree_store/page_store/bitmap.rs:53", entries: 1, str_table: false, offset: 16521, xor: 0x01 },
    Case { name: "cached_file_36", site: "src/tree_store/page_store/cached_file.rs:36", entries: 1, str_table: false, offset: 16549, xor: 0x01 },
    Case { name: "buddy_allocator_269", site: "src/tree_store/page_store/buddy_allocator.rs:269", entries: 1, str_table: false, offset: 16550, xor: 0xff },
    Case { name: "bitmap_366", site: "src/tree_store/page_store/bitmap.rs:366", entries: 1, str_table: false, offset: 16551, xor: 0x02 },
    Case { name: "page_manager_159", site: "src/tree_store/page_store/page_manager.rs:159", entries: 1, str_table: false, offset: 16617, xor: 0x01 },
    Case { name: "page_manager_1797", site: "src/tree_store/page_store/page_manager.rs:1797", entries: 1, str_table: false, offset: 20484, xor: 0x01 },
    Case { name: "page_manager_369", site: "src/tree_store/page_store/page_manager.rs:369", entries: 1, str_table: false, offset: 20650, xor: 0xff },
    Case { name: "btree_base_1926", site: "src/tree_store/btree_base.rs:1926", entries: 1, str_table: false, offset: 24578, xor: 0xff },
    Case { name: "btree_cursor_257", site: "src/tree_store/btree_cursor.rs:257", entries: 1, str_table: false, offset: 28674, xor: 0x01 },
    Case { name: "cached_file_839", site: "src/tree_store/page_store/cached_file.rs:839", entries: 1, str_table: false, offset: 28705, xor: 0x08 },
    Case { name: "buddy_allocator_470", site: "src/tree_store/page_store/buddy_allocator.rs:470", entries: 1, str_table: false, offset: 28705, xor: 0xff },
    Case { name: "table_tree_base_436", site: "src/tree_store/table_tree_base.rs:436", entries: 1, str_table: false, offset: 69640, xor: 0x10 },
    Case { name: "types_803", site: "src/types.rs:803", entries: 1, str_table: true, offset: 8204, xor: 0x80 },
    Case { name: "leaf_mutator_insert", site: "core/src/slice/index.rs", entries: 1, str_table: true, offset: 20713, xor: 0x02 },
    Case { name: "table_tree_base_409", site: "src/tree_store/table_tree_base.rs:409", entries: 1, str_table: true, offset: 69644, xor: 0x20 },
    Case { name: "table_tree_base_429", site: "src/tree_store/table_tree_base.rs:429", entries: 1, str_table: true, offset: 69648, xor: 0x10 },
    Case { name: "btree_base_1954", site: "src/tree_store/btree_base.rs:1954", entries: 300, str_table: true, offset: 20482, xor: 0xff },
    Case { name: "btree_mutator_1176", site: "src/tree_store/btree_mutator.rs:1176", entries: 1, str_table: false, offset: 4096, xor: 0x01 },
    Case { name: "table_tree_212", site: "src/tree_store/table_tree.rs:212", entries: 1, str_table: false, offset: 12300, xor: 0x04 },
    Case { name: "page_manager_1614", site: "src/tree_store/page_store/page_manager.rs:1614", entries: 1, str_table: false, offset: 16513, xor: 0x02 },
    Case { name: "page_manager_2076", site: "src/tree_store/page_store/page_manager.rs:2076", entries: 1, str_table: false, offset: 16509, xor: 0x01 },
    Case { name: "btree_base_1900", site: "src/tree_store/btree_base.rs:1900", entries: 300, str_table: true, offset: 20482, xor: 0xff },
    Case { name: "abort_btree_cursor_463", site: "src/tree_store/btree_cursor.rs:463", entries: 1, str_table: false, offset: 12508, xor: 0x01 },
    Case { name: "abort_btree_cursor_445", site: "src/tree_store/btree_cursor.rs:445", entries: 1, str_table: false, offset: 28675, xor: 0x04 },
    Case { name: "abort_cached_file_97", site: "src/tree_store/page_store/cached_file.rs:97", entries: 1, str_table: false, offset: 16550, xor: 0x01 },
];
// CASES_END

/// FNV-1a 64 of the clean file for (entries, str_table), as produced by redb 4.6.0.
const CLEAN_HASHES: &[(usize, bool, u64)] = &[
    (1, false, 0x30e2_8e59_4fcf_e1c5),
    (1, true, 0x53de_85e6_75d9_9db7),
    (300, true, 0x82ef_6f9e_4cff_71c7),
];

fn build(path: &Path, entries: usize, str_table: bool) {
    let _ = std::fs::remove_file(path);
    let db = Database::create(path).unwrap();
    let tx = db.begin_write().unwrap();
    {
        let mut t = tx.open_table(BYTES).unwrap();
        for i in 0..entries {
            let k = format!("key-{i:05}");
            let v = format!("value-{i:05}-{}", "x".repeat(i % 17));
            t.insert(k.as_bytes(), v.as_bytes()).unwrap();
        }
    }
    if str_table {
        let mut t = tx.open_table(STRS).unwrap();
        for i in 0..entries {
            let k = format!("s{i:05}");
            t.insert(k.as_str(), &[i as u8; 8][..]).unwrap();
        }
    }
    tx.commit().unwrap();
}

fn read_all(db: &Database, str_table: bool) -> Result<usize, redb::Error> {
    let tx = db.begin_read()?;
    let mut n = 0;
    for entry in tx.open_table(BYTES)?.iter()? {
        let (k, v) = entry?;
        n += k.value().len() + v.value().len();
    }
    if str_table {
        for entry in tx.open_table(STRS)?.iter()? {
            let (k, v) = entry?;
            n += k.value().len() + v.value().len();
        }
    }
    Ok(n)
}

fn write_some(db: &Database, str_table: bool, tag: &str) -> Result<(), redb::Error> {
    let tx = db.begin_write()?;
    {
        let mut t = tx.open_table(BYTES)?;
        for i in 0..20 {
            let k = format!("new-{tag}-{i}");
            t.insert(k.as_bytes(), &b"some new value"[..])?;
        }
    }
    if str_table {
        tx.open_table(STRS)?.insert("snew", &b"v"[..])?;
    }
    tx.commit()?;
    Ok(())
}

/// Runs one step; returns true if it panicked.
fn step<T: std::fmt::Debug>(what: &str, f: impl FnOnce() -> Result<T, redb::Error>) -> (Option<T>, bool) {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => {
            println!("  {what}: Ok");
            (Some(v), false)
        }
        Ok(Err(e)) => {
            println!("  {what}: Err({e})");
            (None, false)
        }
        Err(_) => {
            println!("  {what}: PANICKED (see the message above)");
            (None, true)
        }
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn run_case(c: &Case) {
    let path = std::env::temp_dir().join(format!("redb_panic_repro_{}_{}.redb", c.name, std::process::id()));
    build(&path, c.entries, c.str_table);
    let mut bytes = std::fs::read(&path).unwrap();
    let hash = fnv1a(&bytes);
    match CLEAN_HASHES.iter().find(|(n, s, _)| *n == c.entries && *s == c.str_table) {
        Some((_, _, want)) if *want != hash => println!(
            "WARNING: clean file hash {hash:#018x} != {want:#018x} (redb 4.6.0); the offset may point elsewhere"
        ),
        _ => {}
    }
    let old = bytes[c.offset];
    bytes[c.offset] ^= c.xor;
    println!(
        "case {}: {} entries, tables: bytes{}; file {} bytes (clean FNV-1a {hash:#018x}); byte at {:#x} ({}) {old:#04x} -> {:#04x}; expected first panic at {}",
        c.name,
        c.entries,
        if c.str_table { " + strs" } else { "" },
        bytes.len(),
        c.offset,
        c.offset,
        bytes[c.offset],
        c.site
    );
    std::fs::write(&path, &bytes).unwrap();

    let check = std::env::var_os("CHECK").is_some();
    let (db, _) = step("open", || Ok(Database::builder().set_check_integrity_on_open(check).open(&path)?));
    let Some(db) = db else {
        let _ = std::fs::remove_file(&path);
        return;
    };
    let (_, p_read) = step("read every table", || read_all(&db, c.str_table));
    let (_, p_write) = step("insert + commit", || write_some(&db, c.str_table, "a"));
    let (mut p_write2, mut p_read2) = (false, false);
    if p_read || p_write {
        p_write2 = step("insert + commit again (same Database)", || write_some(&db, c.str_table, "b")).1;
        p_read2 = step("read again (same Database)", || read_all(&db, c.str_table)).1;
    }
    let (_, p_drop) = step("drop Database", move || {
        drop(db);
        Ok(())
    });
    if p_write || p_write2 || p_read2 || p_drop {
        let (db, _) = step("reopen the file", || Ok(Database::open(&path)?));
        if let Some(db) = db {
            step("read every table after reopen", || read_all(&db, c.str_table));
            let _ = catch_unwind(AssertUnwindSafe(move || drop(db)));
        }
    }
    let _ = std::fs::remove_file(&path);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(name) = args.first() {
        let c = CASES.iter().find(|c| c.name == name).unwrap_or_else(|| {
            eprintln!("unknown case {name}; cases: {}", CASES.iter().map(|c| c.name).collect::<Vec<_>>().join(" "));
            std::process::exit(2)
        });
        run_case(c);
        return;
    }
    // Every case in its own process: some of them abort the process (a panic while unwinding).
    let exe = std::env::current_exe().unwrap();
    let mut failures = 0;
    for c in CASES {
        let out = std::process::Command::new(&exe).arg(c.name).env("RUST_BACKTRACE", "0").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let first = stderr
            .lines()
            .find_map(|l| l.split(" panicked at ").nth(1))
            .map(|s| s.trim_end_matches(':').to_string())
            .unwrap_or_else(|| "no panic".into());
        let aborted = !out.status.success();
        let hit = stderr.lines().any(|l| l.contains(" panicked at ") && l.contains(c.site));
        if !hit {
            failures += 1;
        }
        println!(
            "{:<28} {} first panic: {first}{}",
            c.name,
            if hit { "REPRODUCED " } else { "NOT REPRODUCED" },
            if aborted { format!("  [process {}]", out.status) } else { String::new() }
        );
    }
    println!("{} of {} cases reproduced", CASES.len() - failures, CASES.len());
}
