"""Compatibility layers: ``lightning/`` holds what exists only so that Lightning code runs
unchanged."""
