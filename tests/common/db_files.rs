//! A redb database file and the engine's journal beside it: where the
//! journal lies, and a copy of both.
//!
//! Include it with `#[path = "common/db_files.rs"] mod db_files;`.

#![allow(dead_code)] // each test file uses what it needs

use std::error::Error;
use std::path::{Path, PathBuf};

/// The journal of database file `db`: `<db>.journal`.
pub fn journal_of(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push(".journal");
    PathBuf::from(name)
}

/// Copies a database file and its journal (if any) into `dir` as `name`;
/// returns the copy's path.
pub fn copy_db(from: &Path, dir: &Path, name: &str) -> Result<PathBuf, Box<dyn Error>> {
    let to = dir.join(name);
    std::fs::copy(from, &to)?;
    let journal = journal_of(from);
    if journal.exists() {
        std::fs::copy(&journal, journal_of(&to))?;
    }
    Ok(to)
}
