CREATE TABLE e_records (scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, state smallint NOT NULL, token bigint NOT NULL, lease_until_ms bigint NOT NULL, unknown_since_ms bigint NOT NULL, expires_at_ms bigint NOT NULL, record bytea NOT NULL, PRIMARY KEY (scope, key));
CREATE INDEX e_leases ON e_records (lease_until_ms) WHERE state = 0;
CREATE INDEX e_recovery ON e_records (unknown_since_ms) WHERE state = 3;
CREATE INDEX e_expiry ON e_records (expires_at_ms) WHERE state IN (1, 2, 4);
CREATE SEQUENCE e_tokens AS bigint START 1;
CREATE TABLE b_idem (scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, state smallint NOT NULL, token bigint NOT NULL, fingerprint bytea NOT NULL, lease_until_ms bigint NOT NULL, expires_at_ms bigint NOT NULL, response bytea, PRIMARY KEY (scope, key));
CREATE INDEX b_leases ON b_idem (lease_until_ms) WHERE state = 0;
CREATE INDEX b_expiry ON b_idem (expires_at_ms) WHERE state = 1;
CREATE SEQUENCE b_tokens AS bigint;
