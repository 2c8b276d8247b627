"""Tables without a primary key: refused by name with remedies, keyed by a replica identity index, or keyed
by columns declared in source.keys (REPLICA IDENTITY FULL required), end to end through the capture."""

from __future__ import annotations

import pytest
from psycopg2 import sql

from lib import config, control, source
from lib.capture import bootstrap, catalog, peek, stream
from lib.capture.catalog import CatalogError
from lib.capture.pgoutput import str_to_lsn
from lib.operate import teardown

pytestmark = pytest.mark.stack

SETUP = """
CREATE SCHEMA kl;
CREATE TABLE kl.visits (visited_at timestamp NOT NULL, branch text NOT NULL, purpose text NOT NULL, note text,
                        customer bigint);
CREATE TABLE kl.codes (code text NOT NULL, label text);
CREATE UNIQUE INDEX codes_code ON kl.codes (code);
ALTER TABLE kl.codes REPLICA IDENTITY USING INDEX codes_code;
CREATE TABLE kl.keyed (id int PRIMARY KEY, v text);
INSERT INTO kl.visits VALUES ('2026-01-01 09:00', 'NYC-01', 'loan', NULL, 1),
                            ('2026-01-01 09:00', 'SFO-01', 'card', 'x', 2);
INSERT INTO kl.codes VALUES ('A', 'alpha'), ('B', 'beta');
"""
DECLARED = {"kl.visits": ["visited_at", "branch"]}


@pytest.fixture(scope="module")
def kl(live_stack, scratch_database, run_id, drop_slot):
    """conf for schema kl of the scratch database: own slot, publication and topic prefix."""
    overrides = {
        "CDC__SOURCE__DATABASE": scratch_database,
        "CDC__SOURCE__SLOT": f"keyless_{run_id}",
        "CDC__SOURCE__PUBLICATION": f"keyless_{run_id}",
        "CDC__SOURCE__TABLES": "[kl.visits, kl.codes]",
        "CDC__SOURCE__KEYS": "{kl.visits: [visited_at, branch]}",
        "CDC__KAFKA__TOPIC_PREFIX": f"cdc-test-{run_id}-keyless",
    }
    conf = config.apply_overrides(live_stack, overrides)
    admin = source.connect(conf, admin=True)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(SETUP)
        cur.execute(sql.SQL("GRANT USAGE ON SCHEMA kl TO {0}; GRANT SELECT ON ALL TABLES IN SCHEMA kl TO {0}")
                    .format(sql.Identifier(config.get(conf, "source.user"))))
    yield conf, admin
    drop_slot(conf, config.get(conf, "source.slot"))
    with admin.cursor() as cur:
        cur.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(
            sql.Identifier(config.get(conf, "source.publication"))))
        cur.execute("DROP SCHEMA kl CASCADE")
    admin.close()
    prefix = config.get(conf, "kafka.topic_prefix")
    teardown.delete_prefix(conf, prefix)


def test_no_key_is_refused_with_every_remedy(kl):
    _, admin = kl
    visits = catalog.describe_tables(admin, ["kl.visits"])["kl.visits"]
    with pytest.raises(CatalogError) as err:
        catalog.check_capturable(visits)
    message = str(err.value)
    assert "kl.visits has no primary key" in message
    assert "would fail on the source" in message
    for remedy in ("ADD PRIMARY KEY", "REPLICA IDENTITY USING INDEX", "source.keys", "REPLICA IDENTITY FULL",
                   "remove the table from source.tables"):
        assert remedy in message


def test_replica_identity_index_keys_a_table_without_primary_key(kl):
    _, admin = kl
    codes = catalog.describe_tables(admin, ["kl.codes"])["kl.codes"]
    catalog.check_capturable(codes)
    assert (codes.primary_key, codes.key_source) == (("code",), "replica identity index codes_code")


def test_declared_key_needs_replica_identity_full(kl):
    _, admin = kl
    visits = catalog.describe_tables(admin, ["kl.visits"], DECLARED)["kl.visits"]
    assert (visits.primary_key, visits.key_source) == (("visited_at", "branch"), "source.keys")
    with pytest.raises(CatalogError, match=r"kl.visits is keyed by source.keys .* replica identity is DEFAULT.*"
                                           r"UPDATE and DELETE on it would fail on the source.*REPLICA IDENTITY FULL"):
        catalog.check_capturable(visits)


@pytest.mark.parametrize("keys, message", [
    ({"kl.visits": ["visited_at", "nope"]}, "names column 'nope', which kl.visits does not have"),
    ({"kl.visits": ["customer"]}, "key column kl.visits.customer allows NULL"),
    ({"kl.visits": []}, "must be a non-empty list"),
    ({"kl.keyed": ["v"]}, "kl.keyed, which has a primary key"),
    ({"kl.other": ["x"]}, "not in source.tables: kl.other"),
])
def test_bad_declared_keys_are_named(kl, keys, message):
    _, admin = kl
    names = ["kl.visits", "kl.keyed"]
    with pytest.raises(CatalogError, match=message):
        catalog.describe_tables(admin, names, keys)


def test_bootstrap_reports_duplicates_then_captures_by_declared_key(kl, drop_slot):
    conf, admin = kl
    _, findings = bootstrap.check(conf)
    failed = {f.check: f for f in findings if not f.ok}
    assert "REPLICA IDENTITY FULL" in failed["kl.visits: keyed"].seen
    with admin.cursor() as cur:
        cur.execute("ALTER TABLE kl.visits REPLICA IDENTITY FULL")
        cur.execute("INSERT INTO kl.visits VALUES ('2026-01-01 09:00', 'NYC-01', 'dup', NULL, 3)")
    _, findings = bootstrap.check(conf)
    failed = {f.check: f for f in findings if not f.ok}
    assert list(failed) == ["kl.visits: declared key (visited_at, branch) unique"]
    assert failed["kl.visits: declared key (visited_at, branch) unique"].seen == "1 key value(s) occur more than once"
    with admin.cursor() as cur:
        cur.execute("DELETE FROM kl.visits WHERE purpose = 'dup'")
    bootstrap.run(conf, log=lambda line: None)

    slot = config.get(conf, "source.slot")
    repl = source.connect(conf, replication=True)
    try:
        cursor = repl.cursor()
        cursor.execute(f'CREATE_REPLICATION_SLOT "{slot}" LOGICAL pgoutput')
        consistent = str_to_lsn(cursor.fetchone()[1])
    finally:
        repl.close()
    control.put(conf, f"snapshot/{slot}", {"state": "complete", "consistent_lsn": consistent, "rows": {}})
    with admin.cursor() as cur:  # these statements would fail on the source without the replica identity
        cur.execute("INSERT INTO kl.visits VALUES ('2026-01-02 10:00', 'NYC-01', 'open account', NULL, 4)")
        cur.execute("UPDATE kl.visits SET note = 'seen' WHERE branch = 'SFO-01'")
        cur.execute("UPDATE kl.visits SET branch = 'BOS-01' WHERE purpose = 'loan'")
        cur.execute("DELETE FROM kl.visits WHERE purpose = 'open account'")
        cur.execute("UPDATE kl.codes SET label = 'ALPHA' WHERE code = 'A'")
        cur.execute("DELETE FROM kl.codes WHERE code = 'B'")
    stream.run(conf, until="caught_up")

    visits = per_key(peek.read(conf, "kl.visits"))
    assert visits == {
        (("branch", "NYC-01"), ("visited_at", "2026-01-02T10:00:00")): ["c", "d", "tombstone"],
        (("branch", "SFO-01"), ("visited_at", "2026-01-01T09:00:00")): ["u"],
        (("branch", "NYC-01"), ("visited_at", "2026-01-01T09:00:00")): ["d", "tombstone"],  # key changed: d + c
        (("branch", "BOS-01"), ("visited_at", "2026-01-01T09:00:00")): ["c"],
    }
    assert per_key(peek.read(conf, "kl.codes")) == {(("code", "A"),): ["u"], (("code", "B"),): ["d", "tombstone"]}


def per_key(events: list[dict]) -> dict:
    """Ops per key (timestamps as ISO text) in offset order; a tombstone is 'tombstone'."""
    found: dict = {}
    for event in sorted(events, key=lambda e: (e["partition"], e["offset"])):
        key = tuple(sorted((k, v.isoformat() if hasattr(v, "isoformat") else v) for k, v in event["key"].items()))
        found.setdefault(key, []).append(event["op"] or "tombstone")
    return found
