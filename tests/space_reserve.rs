//! A full disk must not need more free space to recover than the data does
//! (issue 28.3): on a real small file system (a tmpfs; needs root to mount,
//! skipped with a message otherwise, a failure under `CI=true`), the engine
//! keeps a recovery reserve beside the database, so that (a) a running
//! engine poisoned by a full disk comes back by itself once a little space
//! is freed, (b) a restart on a full disk opens and serves the replays of
//! everything stored, and takes its reserve again once space comes back,
//! and (c) an engine opens and serves on a 2 MiB file
//! system. Before the reserve, (a) and (b) needed 5 MiB freed on an 8 MiB
//! file system, and (c) needed 5 MiB to open at all (the journal grew 4 MiB
//! at a time).

#[path = "common/small_fs.rs"]
mod small_fs;

use idempotency::Engine;
use small_fs::{comes_back, fill, pay, replays, SmallFs, TestResult};

const FS_KIB: u64 = 8 * 1024;

#[test]
fn a_full_disk_with_a_little_freed_comes_back_by_itself() -> TestResult {
    let Some(fs) = SmallFs::mount(FS_KIB)? else {
        return Ok(());
    };
    let engine = Engine::builder().open(fs.db())?;
    let refused = fill(&engine, 0, 100_000)?;
    assert!(engine.poisoned().is_some(), "a refused payment, no poison");
    assert!(refused > 1_000, "only {refused} payments fit in 8 MiB");
    // Nothing freed: it stays down, and says why.
    assert!(!comes_back(&engine, 2), "back on a disk still full");
    // A little freed (256 KiB of 8 MiB): back with no restart.
    fs.resize(FS_KIB + 256)?;
    assert!(
        comes_back(&engine, 10),
        "still down with 256 KiB freed: {:?} ({})",
        engine.poisoned(),
        fs.listing()
    );
    // The refused payment may be left claimed: the next one is new.
    assert!(pay(&engine, refused + 1)?, "a new payment after recovery");
    replays(&engine, refused, Some(refused))?;
    Ok(())
}

#[test]
fn a_restart_on_a_full_disk_opens_and_serves_replays() -> TestResult {
    let Some(fs) = SmallFs::mount(FS_KIB)? else {
        return Ok(());
    };
    let refused = {
        let engine = Engine::builder().open(fs.db())?;
        fill(&engine, 0, 100_000)?
    };
    assert_eq!(fs.free_bytes()? / 4096, 0, "the disk is not full");
    let engine = Engine::builder().open(fs.db()).map_err(|e| {
        format!(
            "no open on a full disk: {e} ({}, {} bytes free)",
            fs.listing(),
            fs.free_bytes().unwrap_or(0)
        )
    })?;
    replays(&engine, refused, Some(refused))?;
    // The reserve went into the recovery; once space comes back, it is
    // taken again (after a checkpoint: every half reserve of journal).
    fs.resize(FS_KIB + 4 * 1024)?;
    let reserve = fs.mnt.join("pay.redb.reserve");
    let held = || std::fs::metadata(&reserve).map_or(0, |m| m.len());
    let mut next = refused + 1;
    while held() < 1 << 20 && next < refused + 5_000 {
        assert!(
            pay(&engine, next)?,
            "payment {next} refused: {:?}",
            engine.poisoned()
        );
        next += 1;
    }
    // (Its target is an eighth of the file system: 1.5 MiB of 12 MiB now.)
    assert!(
        held() >= 1 << 20,
        "the reserve was not taken again ({})",
        fs.listing()
    );
    Ok(())
}

#[test]
fn an_engine_opens_and_serves_on_a_two_mib_file_system() -> TestResult {
    let Some(fs) = SmallFs::mount(2 * 1024)? else {
        return Ok(());
    };
    let engine = Engine::builder()
        .open(fs.db())
        .map_err(|e| format!("no open on 2 MiB: {e} ({})", fs.listing()))?;
    for i in 0..200 {
        assert!(
            pay(&engine, i)?,
            "payment {i} refused: {:?}",
            engine.poisoned()
        );
    }
    replays(&engine, 200, None)?;
    drop(engine);
    let engine = Engine::builder().open(fs.db())?;
    replays(&engine, 200, None)?;
    Ok(())
}
