"""The fleet: audit the nodes (``audit``), pinpoint outliers (``outliers``), keep their history
(``records`` spooled by tpassd and the audit, merged by one writer into a ``store``) and rank the
suspects (``report``). docs/fleet.md describes the whole."""
