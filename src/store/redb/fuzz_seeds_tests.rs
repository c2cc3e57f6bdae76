//! The `stored_structures` fuzz target's seed corpus
//! (`fuzz/corpus/stored_structures`): one input per structure and mode
//! that decodes, so the fuzzer starts past every checksum. Every committed
//! seed must still decode, with the bytes these functions give now.

use std::path::{Path, PathBuf};

use super::fuzz_stored;
use super::journal::fuzz_hook::seed_frames;
use super::partition::filter::{FilterChecksum, FilterHasher, PartitionFilter};
use super::partition::row::PartitionRow;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/stored_structures")
}

/// A seed file's name and its input.
type Seed = (&'static str, Vec<u8>);

/// (file name, input) for every seed.
fn seeds() -> Result<Vec<Seed>, Box<dyn std::error::Error>> {
    let with = |mode: u8, number: u8, bytes: &[u8]| [&[mode, number][..], bytes].concat();
    let mut hot = PartitionRow::hot(1_800_000_000_000, 1_800_086_400_000);
    hot.claimed(1_800_000_000_500, 1_800_086_400_500);
    let mut sealed = hot;
    sealed.seal(7, FilterChecksum([0xab; 32]))?;
    let mut filter = PartitionFilter::with_capacity(7, 64, &FilterHasher::new(&[1; 16]))?;
    for i in 0..40u32 {
        filter.insert(&i.to_le_bytes())?;
    }
    let (filter_bytes, _) = filter.encode();
    let hot_stored = hot.encode(7);
    // The payload alone: the stored value `[version][payload][checksum]`
    // less its version byte and checksum, which the hook adds back.
    let hot_payload = hot_stored[1..=super::partition::row::ROW_PAYLOAD_BYTES].to_vec();
    Ok(vec![
        ("journal-raw.bin", with(0, 4, &seed_frames(4, false))),
        ("journal-framed.bin", with(1, 4, &seed_frames(4, true))),
        ("row-hot.bin", with(2, 7, &hot_stored)),
        ("row-sealed.bin", with(2, 7, &sealed.encode(7))),
        ("row-payload.bin", with(6, 7, &hot_payload)),
        ("filter.bin", with(3, 7, &filter_bytes)),
    ])
}

#[test]
fn every_committed_stored_structures_seed_decodes() -> TestResult {
    let seeds = seeds()?;
    for (name, expected) in &seeds {
        assert!(fuzz_stored(expected), "seed {name} does not decode");
        let committed = std::fs::read(seed_dir().join(name))
            .map_err(|e| format!("seed {name}: {e}; regenerate the seeds (fuzz/README.md)"))?;
        assert!(
            &committed == expected,
            "seed {name} is stale: regenerate the seeds (fuzz/README.md)"
        );
    }
    // Any other file there (a kept crash input) decodes without a panic.
    for entry in std::fs::read_dir(seed_dir())? {
        let _ = fuzz_stored(&std::fs::read(entry?.path())?);
    }
    Ok(())
}

/// Writes the seeds above to `fuzz/corpus/stored_structures`: `cargo test
/// --lib -- --ignored write_stored_structures_seeds`.
#[test]
#[ignore = "writes fuzz/corpus/stored_structures; run by hand"]
fn write_stored_structures_seeds() -> TestResult {
    let dir = seed_dir();
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in seeds()? {
        std::fs::write(dir.join(name), bytes)?;
    }
    Ok(())
}
