"""IceCache and IceCache-reuse (registered here once implemented; see issue 5)."""
