//! Reading the undo log `shim.c` writes, and turning a directory left by a
//! killed child into what a power cut at the same moment would have left:
//! every change no later sync covers is undone (in reverse order), every
//! creation no later sync of its directory covers is removed. With
//! `keep`, a random part of the unsynced writes (whole writes or some of
//! their 4 KiB blocks, in their original order) is put back afterwards: a
//! disk that wrote some of its cache back before power went.

use std::collections::{BTreeMap, HashMap};
use std::error::Error;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

const K_WRITE: u32 = 1;
const K_TRUNC: u32 = 2;
const K_SYNC: u32 = 3;
const K_CREATE: u32 = 4;
const K_DIRSYNC: u32 = 5;
const K_UNLINK: u32 = 6;
const K_RENAME: u32 = 7;
const K_CUT: u32 = 8;
const HEAD: usize = 72;

/// One record of the undo log.
#[derive(Debug)]
pub struct Rec {
    pub kind: u32,
    pub class: u32,
    pub phase: u32,
    pub ino: u64,
    pub off: u64,
    pub old_size: u64,
    pub new_size: u64,
    pub old: Vec<u8>,
    pub new: Vec<u8>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0_u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0_u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Parses the undo log; a record cut short (none expected: the log is
/// written before each operation and survives the kill) is an error.
pub fn read_log(path: &Path) -> Res<Vec<Rec>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        if bytes.len() - at < HEAD {
            return Err(format!("undo log: a record header cut short at {at}").into());
        }
        let h = &bytes[at..at + HEAD];
        let old_len = usize::try_from(u64_at(h, 56))?;
        let new_len = usize::try_from(u64_at(h, 64))?;
        let body = at + HEAD;
        if bytes.len() < body + old_len + new_len {
            return Err(format!("undo log: a record body cut short at {at}").into());
        }
        out.push(Rec {
            kind: u32_at(h, 0),
            class: u32_at(h, 4),
            phase: u32_at(h, 8),
            ino: u64_at(h, 24),
            off: u64_at(h, 32),
            old_size: u64_at(h, 40),
            new_size: u64_at(h, 48),
            old: bytes[body..body + old_len].to_vec(),
            new: bytes[body + old_len..body + old_len + new_len].to_vec(),
        });
        at = body + old_len + new_len;
    }
    Ok(out)
}

/// The cut's (phase, class), if the child was cut.
pub fn cut_of(log: &[Rec]) -> Option<(u32, u32)> {
    log.iter()
        .rev()
        .find(|r| r.kind == K_CUT)
        .map(|r| (r.phase, r.class))
}

/// What a rollback did.
#[derive(Debug, Default)]
pub struct Rolled {
    pub writes_undone: usize,
    pub writes_kept: usize,
    /// Kept: a write of a file kept after an earlier one of the same file
    /// was dropped (a disk that wrote its cache back out of order).
    pub reordered: bool,
    pub creations_removed: Vec<String>,
    /// Removals of the recovery reserve no directory sync covered, undone.
    pub removals_undone: Vec<String>,
}

/// A small deterministic generator (no dependency for a coin).
pub struct Coin(pub u64);

impl Coin {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Whether a namespace record names the engine's recovery reserve
/// (`<db>.reserve`).
fn is_reserve(name: &[u8]) -> bool {
    name.ends_with(b".reserve")
}

/// Turns `dir` into what survives a power cut, given the child's undo log.
/// `keep`: put back a random part of the unsynced writes (needs the log's
/// new bytes, `PC_KEEP_NEW`).
pub fn power_cut(dir: &Path, log: &[Rec], keep: Option<&mut Coin>) -> Res<Rolled> {
    // Which records a later sync covers. A sync record holds the number
    // of records written when the sync began (its `off`): it covers those
    // before that point, not the ones other threads wrote meanwhile.
    let mut synced_files: HashMap<u64, u64> = HashMap::new();
    let mut synced_dirs: HashMap<u64, u64> = HashMap::new();
    for r in log {
        let map = match r.kind {
            K_SYNC => &mut synced_files,
            K_DIRSYNC => &mut synced_dirs,
            _ => continue,
        };
        let upto = map.entry(r.ino).or_default();
        *upto = (*upto).max(r.off);
    }
    let covered = |map: &HashMap<u64, u64>, ino: u64, i: usize| {
        map.get(&ino).is_some_and(|upto| (i as u64) < *upto)
    };
    let mut uncovered = vec![false; log.len()];
    for (i, r) in log.iter().enumerate() {
        match r.kind {
            K_WRITE | K_TRUNC => uncovered[i] = !covered(&synced_files, r.ino, i),
            // `off` holds the parent directory's inode.
            K_CREATE => uncovered[i] = !covered(&synced_dirs, r.off, i),
            // The recovery reserve holds no data (only its length and
            // allocated space count), so an uncovered removal of it is
            // undone below by putting back a file of its old length.
            K_UNLINK
                if is_reserve(&r.new) && !synced_dirs.values().any(|upto| (i as u64) < *upto) =>
            {
                uncovered[i] = true;
            }
            K_UNLINK | K_RENAME if !synced_dirs.values().any(|upto| (i as u64) < *upto) => {
                let name = String::from_utf8_lossy(&r.new);
                return Err(format!(
                    "the child unlinked or renamed {name} without syncing its directory: \
                     this layer does not roll those back"
                )
                .into());
            }
            _ => {}
        }
    }
    let mut paths: HashMap<u64, std::path::PathBuf> = HashMap::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.is_file() {
            paths.insert(meta.ino(), entry.path());
        }
    }
    let mut rolled = Rolled::default();
    let mut files = BTreeMap::new();
    for (i, r) in log.iter().enumerate().rev() {
        if !uncovered[i] || !(r.kind == K_WRITE || r.kind == K_TRUNC) {
            continue;
        }
        let Some(path) = paths.get(&r.ino) else {
            continue;
        };
        let file = match files.entry(r.ino) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(OpenOptions::new().read(true).write(true).open(path)?)
            }
        };
        // The file as it was before this change: its old bytes (what the
        // change covered of the old length), then its old length.
        if r.kind == K_TRUNC {
            file.set_len(r.old_size)?;
            file.write_all_at(&r.old, r.off)?;
        } else {
            file.write_all_at(&r.old, r.off)?;
            file.set_len(r.old_size)?;
        }
        rolled.writes_undone += 1;
    }
    if let Some(coin) = keep {
        let mut dropped = std::collections::HashSet::new();
        for (i, r) in log.iter().enumerate() {
            if !uncovered[i] || !(r.kind == K_WRITE || r.kind == K_TRUNC) {
                continue;
            }
            let Some(file) = files.get(&r.ino) else {
                continue;
            };
            let roll = coin.next() % 10;
            if roll < 5 {
                dropped.insert(r.ino);
                continue;
            }
            rolled.reordered |= dropped.contains(&r.ino);
            if r.kind == K_TRUNC {
                file.set_len(r.new_size)?;
            } else if r.new.is_empty() && r.off < r.new_size {
                return Err("keeping writes needs their new bytes (PC_KEEP_NEW)".into());
            } else {
                if file.metadata()?.len() < r.new_size {
                    file.set_len(r.new_size)?;
                }
                // Whole (3 in 5 of the kept writes) or some of its blocks.
                for (n, block) in r.new.chunks(4096).enumerate() {
                    if roll < 7 && coin.next() % 2 == 0 {
                        continue;
                    }
                    file.write_all_at(block, r.off + 4096 * n as u64)?;
                }
            }
            rolled.writes_kept += 1;
        }
    }
    drop(files);
    for (i, r) in log.iter().enumerate().rev() {
        if uncovered[i] && r.kind == K_CREATE {
            let name = String::from_utf8_lossy(&r.new).to_string();
            let path = dir.join(&name);
            if std::fs::metadata(&path).is_ok_and(|m| m.ino() == r.ino) {
                std::fs::remove_file(&path)?;
                rolled.creations_removed.push(name);
            }
        }
        if uncovered[i] && r.kind == K_UNLINK {
            let name = String::from_utf8_lossy(&r.new).to_string();
            let path = dir.join(&name);
            if std::fs::metadata(&path).is_err() {
                OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)?
                    .set_len(r.old_size)?;
                rolled.removals_undone.push(name);
            }
        }
    }
    Ok(rolled)
}
