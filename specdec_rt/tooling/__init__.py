"""Tools built on the library, not part of it: bench, loadtest, the demo, reports, prompt data."""
