"""The hicache backend conformance suite (filled in by the conformance work)."""
