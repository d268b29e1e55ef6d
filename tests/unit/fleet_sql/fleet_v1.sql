-- The fleet store as schema version 1 wrote it (torchpass/fleet/store.py, _v1), with two rows:
-- a migration test opens this after the upgrade and finds them intact.
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version VALUES (1);
CREATE TABLE records (id INTEGER PRIMARY KEY, ts REAL NOT NULL, kind TEXT NOT NULL, node TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE job_cursor (job INTEGER PRIMARY KEY, seq INTEGER NOT NULL);
INSERT INTO records (ts, kind, node, data) VALUES (1000.0, 'health.change', 'node2',
  '{"schema":1,"ts":1000.0,"kind":"health.change","node":"node2","state":"failed","previous":"healthy","reasons":["gpu0: xid 79"]}');
INSERT INTO records (ts, kind, node, data) VALUES (1010.0, 'job.migration', 'node2',
  '{"schema":1,"ts":1010.0,"kind":"job.migration","node":"node2","job":42,"user":"tpuser1","outcome":"completed","target":"node4","ranks_moved":2}');
INSERT INTO job_cursor VALUES (42, 17);
