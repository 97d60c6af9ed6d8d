"""Cache tiers: resident (the server's slots), disk (prefix anchors) and session (spilled conversations)."""
