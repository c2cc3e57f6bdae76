//! The `partitions` row codec (round trips, golden bytes, damage and rule
//! breaks refused naming the partition, never a panic) and the partition
//! table names (sorted by age, parsed back exactly, nothing else
//! accepted).

use proptest::prelude::*;

use super::*;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn sealed_row() -> PartitionRow {
    let mut row = PartitionRow::hot(1_800_000_000_000, 1_800_086_400_000);
    row.claimed(1_800_000_000_500, 1_800_086_400_500);
    row.claimed(1_799_999_999_000, 1_800_086_399_000);
    row
}

fn problem(partition: u64, bytes: &[u8]) -> Result<PartitionRow, RowProblem> {
    PartitionRow::decode(partition, bytes).map_err(|e| {
        assert_eq!(e.partition, partition);
        e.problem
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn rows_round_trip_through_their_life() -> TestResult {
    let mut row = sealed_row();
    assert_eq!(row.keys, 3);
    // Claim times widen the range in any order.
    assert_eq!(row.first_claim_ms, 1_799_999_999_000);
    assert_eq!(row.last_claim_ms, 1_800_000_000_500);
    assert_eq!(row.max_expires_at_ms, 1_800_086_400_500);
    assert_eq!(PartitionRow::decode(3, &row.encode(3))?, row);

    row.seal(3, FilterChecksum([0xab; 32]))?;
    assert_eq!(row.state, PartitionState::Sealed);
    assert_eq!(PartitionRow::decode(3, &row.encode(3))?, row);

    // A merge source keeps its filter; a dropping row has none.
    row.state = PartitionState::MergeSource;
    assert_eq!(PartitionRow::decode(3, &row.encode(3))?, row);
    row.state = PartitionState::Dropping;
    row.filter_checksum = None;
    let bytes = row.encode(3);
    assert_eq!(bytes.len(), 1 + ROW_PAYLOAD_BYTES + 8);
    assert_eq!(PartitionRow::decode(3, &bytes)?, row);
    Ok(())
}

#[test]
fn only_a_hot_row_is_sealed() -> TestResult {
    let mut hot = PartitionRow::hot(10, 20);
    hot.seal(6, FilterChecksum([1; 32]))?;
    let again = hot.seal(6, FilterChecksum([2; 32])).map_err(|e| e.problem);
    assert_eq!(
        again,
        Err(RowProblem::Transition {
            action: "seal",
            from: PartitionState::Sealed
        })
    );
    assert_eq!(hot.filter_checksum, Some(FilterChecksum([1; 32])));
    hot.state = PartitionState::Dropping;
    assert!(hot.seal(6, FilterChecksum([1; 32])).is_err());
    let text = hot
        .seal(6, FilterChecksum([1; 32]))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("partition 6") && text.contains("cannot seal a Dropping"),
        "{text}"
    );
    Ok(())
}

#[test]
fn golden_row_bytes() {
    // The row's bytes are format 3's: a change here is a format change.
    let mut row = PartitionRow::hot(0x0102, 0x0304);
    row.claimed(0x0105, 0x0306);
    let hot = row.encode(42);
    // [2][state 0][keys 2][first 0x0102][last 0x0105][max expiry 0x0306]
    // [no filter: 32 zero bytes][rapidhash checksum].
    assert_eq!(
        hex(&hot),
        "02\
         00\
         0200000000000000\
         0201000000000000\
         0501000000000000\
         0603000000000000\
         0000000000000000000000000000000000000000000000000000000000000000\
         a389f76e1c32d9f3"
    );
    let mut sealed = row;
    sealed
        .seal(42, FilterChecksum([0x5a; 32]))
        .map_err(|e| e.to_string())
        .unwrap();
    let sealed_hex = hex(&sealed.encode(42));
    assert_eq!(&sealed_hex[..2], "02");
    assert_eq!(&sealed_hex[2..4], "01");
    assert_eq!(&sealed_hex[4..68], &hex(&hot)[4..68]);
    assert_eq!(&sealed_hex[68..132], "5a".repeat(32));
    assert_eq!(&sealed_hex[132..], "4c49395b45c66026");
}

#[test]
fn damaged_rows_are_refused() {
    let good = sealed_row().encode(7);
    assert!(matches!(
        problem(7, &[]),
        Err(RowProblem::Frame(DecodeError::Empty))
    ));
    assert!(matches!(
        problem(7, &good[..8]),
        Err(RowProblem::Frame(DecodeError::Truncated(8)))
    ));
    for i in 0..good.len() {
        for bit in 0..8 {
            let mut bad = good.clone();
            bad[i] ^= 1 << bit;
            assert!(
                problem(7, &bad).is_err(),
                "flip of bit {bit} of byte {i} decoded"
            );
        }
    }
    for cut in 0..good.len() {
        assert!(problem(7, &good[..cut]).is_err(), "prefix {cut} decoded");
    }
    // Another partition's row.
    assert_eq!(
        problem(8, &good),
        Err(RowProblem::Frame(DecodeError::ChecksumMismatch))
    );
    // A meta value under the same key bytes (partition 0x61 is "a\0..."
    // as bytes) belongs to another table.
    let name = std::str::from_utf8(&0x61u64.to_le_bytes())
        .map(str::to_owned)
        .unwrap_or_default();
    let payload = &sealed_row().encode(0x61)[1..1 + ROW_PAYLOAD_BYTES];
    let as_meta = codec::encode_meta(&name, payload);
    assert_eq!(
        problem(0x61, &as_meta),
        Err(RowProblem::Frame(DecodeError::ChecksumMismatch))
    );
    assert!(PartitionRow::decode(
        0x61,
        &codec::framed(ROW_TAG, &0x61u64.to_le_bytes(), payload)
    )
    .is_ok());
}

#[test]
fn rows_that_break_the_rules_are_refused_even_with_a_good_checksum() {
    let framed = |payload: &[u8]| codec::framed(ROW_TAG, &1u64.to_le_bytes(), payload);
    let mut payload = [0u8; ROW_PAYLOAD_BYTES];
    payload[1] = 1;
    assert!(problem(1, &framed(&payload)).is_ok());
    assert_eq!(
        problem(1, &framed(&payload[..64])),
        Err(RowProblem::Length(64))
    );
    let mut long = payload.to_vec();
    long.push(0);
    assert_eq!(problem(1, &framed(&long)), Err(RowProblem::Length(66)));
    let mut p = payload;
    p[0] = 0xff;
    assert_eq!(problem(1, &framed(&p)), Err(RowProblem::State(0xff)));
    let mut p = payload;
    p[9] = 2; // first_claim_ms = 2 > last_claim_ms = 0
    assert_eq!(
        problem(1, &framed(&p)),
        Err(RowProblem::ClaimOrder {
            first_ms: 2,
            last_ms: 0
        })
    );
    let mut p = payload;
    p[64] = 1;
    assert_eq!(problem(1, &framed(&p)), Err(RowProblem::HotWithFilter));
    let mut p = payload;
    p[0] = 1;
    assert_eq!(
        problem(1, &framed(&p)),
        Err(RowProblem::SealedWithoutFilter)
    );
    p[40] = 9;
    assert!(problem(1, &framed(&p)).is_ok());
    // Dropping and merging: no filter; a merge source: one.
    for state in [2, 3] {
        let mut p = payload;
        p[0] = state;
        assert!(problem(1, &framed(&p)).is_ok());
        p[33] = 1;
        assert_eq!(problem(1, &framed(&p)), Err(RowProblem::UnreadWithFilter));
    }
    let mut p = payload;
    p[0] = 4;
    assert_eq!(
        problem(1, &framed(&p)),
        Err(RowProblem::SealedWithoutFilter)
    );
    p[40] = 9;
    assert!(problem(1, &framed(&p)).is_ok());
    p[0] = 5;
    assert_eq!(problem(1, &framed(&p)), Err(RowProblem::State(5)));
    let text = PartitionRow::decode(11, &[])
        .map(|_| ())
        .map_err(|e| e.to_string())
        .unwrap_err();
    assert!(
        text.contains("partition 11") && text.contains(PARTITIONS_TABLE),
        "{text}"
    );
}

proptest! {
    #[test]
    fn row_decode_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..120), p in any::<u64>()) {
        // Random bytes never carry the right checksum.
        prop_assert!(PartitionRow::decode(p, &bytes).is_err());
    }

    #[test]
    fn row_payload_rules_never_panic(payload in proptest::collection::vec(any::<u8>(), 60..70), p in any::<u64>()) {
        // Framed with the right checksum: past the frame, into the fields.
        let bytes = codec::framed(ROW_TAG, &p.to_le_bytes(), &payload);
        if let Ok(row) = PartitionRow::decode(p, &bytes) {
            prop_assert_eq!(row.encode(p), bytes);
        }
    }

    #[test]
    fn any_row_round_trips(
        state in 0u8..5,
        keys in any::<u64>(),
        a in any::<u64>(),
        b in any::<u64>(),
        exp in any::<u64>(),
        sum in any::<[u8; 32]>(),
        p in any::<u64>(),
    ) {
        let state = PartitionState::from_byte(state).unwrap_or(PartitionState::Hot);
        let row = PartitionRow {
            state,
            keys,
            first_claim_ms: a.min(b),
            last_claim_ms: a.max(b),
            max_expires_at_ms: exp,
            filter_checksum: (state != PartitionState::Hot && sum != [0; 32]).then_some(FilterChecksum(sum)),
        };
        let bytes = row.encode(p);
        let filtered = matches!(state, PartitionState::Sealed | PartitionState::MergeSource);
        match PartitionRow::decode(p, &bytes) {
            Ok(back) => prop_assert_eq!(back, row),
            Err(e) if filtered => prop_assert_eq!(e.problem, RowProblem::SealedWithoutFilter),
            Err(e) => prop_assert_eq!(e.problem, RowProblem::UnreadWithFilter),
        }
    }
}

/// The fuzz hook decodes a stored row as is, and a row's payload framed
/// by the hook; a flipped byte in the stored form is refused.
#[test]
fn the_fuzz_hook_decodes_rows_stored_and_framed() {
    let stored = sealed_row().encode(5);
    assert!(fuzz_decode(5, false, &stored));
    let mut flipped = stored.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    assert!(!fuzz_decode(5, false, &flipped));
    // The payload alone (65 bytes: state, counts, times, no filter yet).
    let mut payload = [0u8; ROW_PAYLOAD_BYTES];
    payload[1] = 3;
    assert!(fuzz_decode(5, true, &payload));
    assert!(!fuzz_decode(5, true, &payload[..64]));
}
