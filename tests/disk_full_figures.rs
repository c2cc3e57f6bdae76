//! The disk-full experiment of issue 28 as an opt-in harness (`#[ignore]`d:
//! it prints figures, it guards nothing by itself): an 8 MiB tmpfs is
//! filled with payments in the demo's shape until the engine refuses one,
//! then space is freed in growing steps (the tmpfs is remounted larger, so
//! no file of the engine is touched) until the engine serves again, by
//! itself (running server) or on a fresh open (restart). Also whether an
//! engine opens and serves on a 2 MiB file system. Needs root for `mount`.
//!
//! ```text
//! cargo test --release --test suite disk_full_figures:: -- --ignored --nocapture --test-threads 1
//! ```

#[path = "common/small_fs.rs"]
mod small_fs;

use idempotency::Engine;
use small_fs::{comes_back, fill, pay, replays, SmallFs, TestResult};

const FS_KIB: u64 = 8 * 1024;
/// Freed space tried, KiB, in order.
const STEPS_KIB: [u64; 16] = [
    0, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192, 16384,
];
const MAX_PAYMENTS: usize = 100_000;

#[test]
#[ignore = "an experiment that prints figures; needs root (see the module docs)"]
fn figures_running_server_comes_back() -> TestResult {
    let Some(fs) = SmallFs::mount(FS_KIB)? else {
        return Ok(());
    };
    let engine = Engine::builder().open(fs.db())?;
    let refused = fill(&engine, 0, MAX_PAYMENTS)?;
    println!(
        "running: {refused} payments stored on {FS_KIB} KiB, free {} B; {}",
        fs.free_bytes()?,
        fs.listing()
    );
    for step in STEPS_KIB {
        fs.resize(FS_KIB + step)?;
        let back = comes_back(&engine, 3);
        let why = engine.poisoned().unwrap_or_default();
        // The refused payment may be left claimed: the next one is new.
        if back && pay(&engine, refused + 1)? {
            replays(&engine, refused, Some(refused))?;
            println!(
                "FIGURE running server: back after {step} KiB freed ({})",
                fs.listing()
            );
            return Ok(());
        }
        println!("  {step} KiB freed: still down: {why} ({})", fs.listing());
    }
    println!(
        "FIGURE running server: not back after {} KiB freed",
        STEPS_KIB[STEPS_KIB.len() - 1]
    );
    Ok(())
}

#[test]
#[ignore = "an experiment that prints figures; needs root (see the module docs)"]
fn figures_restart_on_a_full_disk() -> TestResult {
    let Some(fs) = SmallFs::mount(FS_KIB)? else {
        return Ok(());
    };
    let refused = {
        let engine = Engine::builder().open(fs.db())?;
        fill(&engine, 0, MAX_PAYMENTS)?
    };
    println!(
        "restart: {refused} payments stored on {FS_KIB} KiB, free {} B after close; {}",
        fs.free_bytes()?,
        fs.listing()
    );
    match Engine::builder().open(fs.db()) {
        Ok(engine) => {
            replays(&engine, refused, Some(refused))?;
            println!("FIGURE restart: opens with 0 KiB freed, {refused} replays served");
            return Ok(());
        }
        Err(e) => println!("  0 KiB freed: {e} ({})", fs.listing()),
    }
    for step in STEPS_KIB.into_iter().skip(1) {
        fs.resize(FS_KIB + step)?;
        match Engine::builder().open(fs.db()) {
            Ok(engine) => {
                replays(&engine, refused, Some(refused))?;
                println!(
                    "FIGURE restart: opens after {step} KiB freed, {refused} replays served ({})",
                    fs.listing()
                );
                return Ok(());
            }
            Err(e) => println!("  {step} KiB freed: {e} ({})", fs.listing()),
        }
    }
    println!(
        "FIGURE restart: does not open after {} KiB freed",
        STEPS_KIB[STEPS_KIB.len() - 1]
    );
    Ok(())
}

#[test]
#[ignore = "an experiment that prints figures; needs root (see the module docs)"]
fn figures_smallest_file_system_that_serves() -> TestResult {
    for kib in [512, 1024, 1536, 2048, 3072, 4096, 5120, 6144] {
        let Some(fs) = SmallFs::mount(kib)? else {
            return Ok(());
        };
        match Engine::builder().open(fs.db()) {
            Ok(engine) if pay(&engine, 0)? => {
                println!(
                    "FIGURE smallest: opens and serves on {kib} KiB ({})",
                    fs.listing()
                );
                return Ok(());
            }
            Ok(engine) => println!(
                "  {kib} KiB: opens, first payment refused: {:?}",
                engine.poisoned()
            ),
            Err(e) => println!("  {kib} KiB: {e}"),
        }
    }
    Ok(())
}
