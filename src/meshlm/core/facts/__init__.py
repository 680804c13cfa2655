"""What a feature's runtime module and its pricing module must agree on, in one place: keys, wire formats
and byte formulas (docs/architecture.md, "A feature's three rooms"). Pure Python."""
