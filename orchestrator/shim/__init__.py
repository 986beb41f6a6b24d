"""The HTTP shim (filled in below)."""
