//! The durability judgment of a Redis server's settings (`judge`): what
//! each combination opens or refuses, and what the refusal says.

use super::{judge, Setting, Settings};
use crate::error::OpenError;

fn read(v: &str) -> Setting {
    Setting::Read(v.to_owned())
}

fn blocked() -> Setting {
    Setting::Unreadable("CONFIG GET: NOPERM".to_owned())
}

fn durable() -> Settings {
    Settings {
        appendonly: read("yes"),
        appendfsync: read("always"),
        maxmemory_policy: read("noeviction"),
    }
}

#[test]
fn a_durable_server_that_never_evicts_opens() {
    assert!(judge(durable(), false, false).is_ok());
    let mut s = durable();
    s.maxmemory_policy = read("volatile-lru");
    assert!(
        judge(s, false, false).is_ok(),
        "volatile-* never evicts our keys"
    );
}

#[test]
fn everysec_is_refused_naming_the_setting_unless_volatile_is_allowed() {
    let mut s = durable();
    s.appendfsync = read("everysec");
    match judge(s.clone(), false, false) {
        Err(e @ OpenError::RedisNotDurable { .. }) => {
            let text = e.to_string();
            assert!(text.contains("appendfsync everysec"), "{text}");
            assert!(text.contains("CONFIG SET appendfsync always"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        judge(s.clone(), false, true).is_err(),
        "a read value is checked even when attested"
    );
    assert!(judge(s, true, false).is_ok());
}

#[test]
fn allkeys_eviction_is_refused_unless_volatile_is_allowed() {
    let mut s = durable();
    s.maxmemory_policy = read("allkeys-lru");
    match judge(s.clone(), false, true) {
        Err(OpenError::RedisEvicts { policy }) => assert_eq!(policy, "allkeys-lru"),
        other => panic!("{other:?}"),
    }
    assert!(judge(s, true, false).is_ok());
}

/// A policy the server answers nothing for (a proxy, a server that is not
/// Redis) or refuses to show may be `allkeys-*`: refused with the way out,
/// and the refusal's fix names the policy, not a persistence setting.
#[test]
fn an_unreadable_eviction_policy_is_refused_unless_attested() {
    for unreadable in [
        Setting::Unreadable("CONFIG GET answered nothing".to_owned()),
        blocked(),
    ] {
        let mut s = durable();
        s.maxmemory_policy = unreadable;
        match judge(s.clone(), false, false) {
            Err(e @ OpenError::RedisEvicts { .. }) => {
                let text = e.to_string();
                assert!(text.contains("maxmemory-policy unreadable ("), "{text}");
                assert!(text.contains("redis_durability_attested(true)"), "{text}");
                assert!(
                    text.contains("CONFIG SET maxmemory-policy noeviction"),
                    "{text}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(judge(s.clone(), false, true).is_ok());
        assert!(judge(s, true, false).is_ok());
    }
}

/// A server that blocks `CONFIG`: the first refusal names `appendonly`
/// and the way out.
#[test]
fn a_server_that_blocks_config_is_refused_with_the_attestation_hint() {
    let s = Settings {
        appendonly: blocked(),
        appendfsync: blocked(),
        maxmemory_policy: blocked(),
    };
    match judge(s.clone(), false, false) {
        Err(OpenError::RedisNotDurable { setting, found }) => {
            assert_eq!(setting, "appendonly");
            assert!(
                found.starts_with("unreadable (CONFIG GET: NOPERM)"),
                "{found}"
            );
            assert!(found.contains("redis_durability_attested(true)"), "{found}");
        }
        other => panic!("{other:?}"),
    }
    assert!(judge(s, false, true).is_ok());
}
