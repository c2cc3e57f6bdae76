//! The steps and history tables on PostgreSQL: a schema made before them
//! (an older build's) opens as it is and gains them on the next writable
//! open; `verify` names a damaged step and a damaged log entry; a
//! read-only open reads both. Needs `IDEMPOTENCY_TEST_PG`
//! (`scripts/with-postgres`); skipped with a note without it.

use std::sync::Arc;

use crate::clock::ManualClock;
use crate::envelope::Envelope;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::policy::ExpiryPolicy;
use crate::store::config::StoreConfig;
use crate::store::record::{hex, StoredResponse};
use crate::store::{
    Backend, ClaimRequest, ClaimResult, CompleteRequest, Completion, FinishStepRequest, StepRequest,
};
use crate::verify::Damage;

use super::{Mode, PgOptions, PgStore};
use crate::store::read_only::ReadOnly;

pub(super) type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const PG_ENV: &str = "IDEMPOTENCY_TEST_PG";
pub(super) const T0: u64 = 1_796_000_000_000;

/// The server's URL, or `None` (the test is skipped, and says so).
pub(super) fn url(test: &str) -> Option<String> {
    let url = std::env::var(PG_ENV).ok();
    if url.is_none() {
        eprintln!("{test}: skipped ({PG_ENV} is not set; see scripts/with-postgres)");
    }
    url
}

pub(super) fn prefix(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("stt_{test}_{}_{}_", std::process::id(), nanos % 1_000_000)
}

pub(super) fn open(url: &str, prefix: &str, mode: Mode, clock: &ManualClock) -> R<PgStore> {
    let opts = PgOptions {
        url: url.to_owned(),
        prefix: prefix.to_owned(),
        pool_size: 2,
        connect_timeout: std::time::Duration::from_secs(5),
        statement_timeout: std::time::Duration::from_secs(10),
        pool_idle_timeout: None,
        pool_max_lifetime: None,
        database_clock: false,
        mode,
    };
    let cfg = StoreConfig {
        ttl_ms: 60_000,
        expiry: ExpiryPolicy::Forget,
        max_response_bytes: 1 << 20,
    };
    Ok(PgStore::open(&opts, cfg, false, Arc::new(clock.clone()))?.0)
}

fn sql(url: &str, statements: &str) -> R<()> {
    let mut client = postgres::Client::connect(url, postgres::NoTls)?;
    client.batch_execute(statements)?;
    Ok(())
}

/// A claim of `key` with two confirmed calls, completed.
fn two_calls(store: &PgStore, key: &IdempotencyKey) -> R<()> {
    let ClaimResult::Claimed(c) = store.claim(ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([5; 32]),
        lease_ms: 30_000,
    })?
    else {
        return Err("held".into());
    };
    for name in ["charge", "receipt"] {
        store.reserve_step(StepRequest {
            key: key.clone(),
            token: c.token,
            name: name.into(),
            finished: Vec::new(),
        })?;
        store.finish_step(FinishStepRequest {
            key: key.clone(),
            token: c.token,
            name: name.into(),
            confirmed: true,
            evidence: name.as_bytes().to_vec(),
        })?;
    }
    store.complete(CompleteRequest {
        key: key.clone(),
        token: c.token,
        completion: Completion::Success,
        response: StoredResponse::new(Envelope::new(1, 200, b"ok".to_vec()), None),
        messages: Vec::new(),
        finished: Vec::new(),
    })?;
    Ok(())
}

#[test]
fn a_schema_from_before_steps_opens_and_gains_the_tables() -> R<()> {
    let Some(url) = url("a_schema_from_before_steps_opens_and_gains_the_tables") else {
        return Ok(());
    };
    let p = prefix("before");
    let clock = ManualClock::new(T0);
    let k = IdempotencyKey::new("shop", "pay-1")?;
    drop(open(&url, &p, Mode::Create, &clock)?);
    // What an older build's schema looks like.
    sql(
        &url,
        &format!("DROP TABLE {p}steps; DROP TABLE {p}history;"),
    )?;
    // A writable open without DDL says which tables it needs.
    match open(&url, &p, Mode::Existing, &clock) {
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains(&format!("{p}steps")) && text.contains(&format!("{p}history")),
                "{text}"
            );
        }
        Ok(_) => return Err("an open without DDL ran without the step tables".into()),
    }
    // A read-only open reads no steps there, and verifies.
    let store = open(&url, &p, Mode::ReadOnly, &clock)?;
    assert!(store.steps(&k)?.is_empty());
    assert!(store.history(&k)?.is_empty());
    let (damage, _) = store.verify()?;
    assert!(damage.is_empty(), "{damage:?}");
    drop(store);
    let store = open(&url, &p, Mode::Create, &clock)?;
    two_calls(&store, &k)?;
    assert_eq!(store.steps(&k)?.len(), 2);
    assert_eq!(store.history(&k)?.len(), 5);
    Ok(())
}

#[test]
fn verify_names_a_damaged_step_and_log_entry_and_read_only_reads_them() -> R<()> {
    let Some(url) = url("verify_names_a_damaged_step_and_log_entry_and_read_only_reads_them")
    else {
        return Ok(());
    };
    let p = prefix("verify");
    let clock = ManualClock::new(T0);
    let k = IdempotencyKey::new("shop", "pay-1")?;
    let store = open(&url, &p, Mode::Create, &clock)?;
    two_calls(&store, &k)?;
    let (steps, log) = (store.steps(&k)?, store.history(&k)?);
    let reader = ReadOnly(open(&url, &p, Mode::ReadOnly, &clock)?);
    assert_eq!(reader.steps(&k)?, steps);
    assert_eq!(reader.history(&k)?, log);
    assert!(matches!(
        reader.reserve_step(StepRequest {
            key: k.clone(),
            token: 1,
            name: "x".into(),
            finished: Vec::new(),
        }),
        Err(crate::error::Error::ReadOnly { .. })
    ));
    sql(
        &url,
        &format!(
            "UPDATE {p}steps SET step = set_byte(step, 3, get_byte(step, 3) # 16)
                 WHERE scope = 'shop' AND key = 'pay-1' AND name = 'receipt';
             UPDATE {p}history SET entry = set_byte(entry, 2, get_byte(entry, 2) # 1)
                 WHERE scope = 'shop' AND key = 'pay-1' AND seq = 1;"
        ),
    )?;
    let (damage, _) = store.verify()?;
    let key_hex = hex(k.record_key());
    assert_eq!(damage.len(), 2, "{damage:?}");
    assert!(
        damage.iter().any(|d| matches!(d, Damage::UndecodableStep { key_hex: h, step, .. } if *h == key_hex && step == "receipt")),
        "{damage:?}"
    );
    assert!(
        damage.iter().any(
            |d| matches!(d, Damage::UndecodableHistory { key_hex: h, seq: 1, .. } if *h == key_hex)
        ),
        "{damage:?}"
    );
    Ok(())
}
