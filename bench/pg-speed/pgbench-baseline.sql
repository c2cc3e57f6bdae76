\set k random(1, 2000000000)
INSERT INTO b_idem (scope, key, state, token, fingerprint, lease_until_ms, expires_at_ms) VALUES ('bench', :k::text || '-' || :client_id, 0, nextval('b_tokens'), decode(repeat('07', 32), 'hex'), 1000, 0) ON CONFLICT (scope, key) DO NOTHING RETURNING token;
UPDATE b_idem SET state = 1, response = decode(repeat('78', 300), 'hex'), expires_at_ms = 86400000 WHERE scope = 'bench' AND key = :k::text || '-' || :client_id AND token = token AND state = 0;
