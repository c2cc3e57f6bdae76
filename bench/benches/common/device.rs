//! Bytes the block device itself wrote, from its sector counter
//! (`/sys/dev/block/MAJ:MIN/stat`, field 7, in 512-byte sectors), for
//! the file system a bench directory lives on.
//!
//! Unlike `/proc/self/io`'s `write_bytes` (see `DiskWrites`), this counts
//! what reached the device: no page-cache charging, and the file system's
//! own journal and metadata writes are in. It is the whole device, so every
//! other process's writes are in too: it means something only on an
//! otherwise idle machine, and each reading starts and ends with a
//! `sync` (of every file system), so writes the kernel holds back land in
//! the reading they belong to.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The sector counter of the device holding one directory.
pub struct Device {
    stat: PathBuf,
}

impl Device {
    /// The device `dir` is on; `None` if its counter cannot be read (not
    /// Linux, no sysfs, or a file system without a block device, such as
    /// a tmpfs or an overlay).
    pub fn of(dir: &Path) -> Option<Device> {
        let dev = std::fs::metadata(dir).ok()?.dev();
        // glibc's gnu_dev_major / gnu_dev_minor.
        let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
        let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
        let stat = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
        let device = Device { stat };
        device.sectors()?;
        Some(device)
    }

    fn sectors(&self) -> Option<u64> {
        let text = std::fs::read_to_string(&self.stat).ok()?;
        text.split_whitespace().nth(6)?.parse().ok()
    }

    /// Flushes every file system (`sync`), then reads the bytes written
    /// so far. `None` if `sync` or the counter fails.
    pub fn written_after_sync(&self) -> Option<u64> {
        let synced = std::process::Command::new("sync").status().ok()?;
        if !synced.success() {
            return None;
        }
        Some(self.sectors()? * 512)
    }
}
