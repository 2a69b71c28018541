"""Model definitions: one decoder-only transformer with small per-family differences."""
