//! Listings (`Engine::records`, what `idem inspect` prints) come in the
//! same order on every backend: (scope, key) by bytes. redb's table is
//! ordered by scope length first, so scopes of different lengths used to
//! come out in another order than on PostgreSQL, and `inspect --limit N`
//! showed different records on each.

use idempotency::{Envelope, IdempotencyKey, RecordFilter};

use super::support::*;

both_backends! {
    fn records_are_listed_in_scope_then_key_byte_order(h: &Harness) -> TestResult {
        let engine = h.engine()?;
        let scopes = ["b", "a:long", "ab", "a b", "a", "POST /payments tenant=9", "POST /p"];
        let keys = ["z", "a", "ab", "a-1"];
        let mut expected = Vec::new();
        for scope in scopes {
            for k in keys {
                let key = IdempotencyKey::new(scope, k)?;
                let claim = claimed(engine.begin(&key, fp(1)?)?)?;
                engine.complete(claim, Envelope::new(1, 200, "ok"))?;
                expected.push((scope.as_bytes().to_vec(), k.as_bytes().to_vec()));
            }
        }
        expected.sort();
        let listed = engine
            .records(&RecordFilter::default())?
            .into_iter()
            .map(|r| r.map(|r| (r.key.scope().as_bytes().to_vec(), r.key.key().as_bytes().to_vec())))
            .collect::<Result<Vec<_>, _>>()?;
        assert_eq!(listed, expected);
        Ok(())
    }
}
