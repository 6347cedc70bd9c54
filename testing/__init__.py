"""Test and benchmark support, not the host's runtime: tiny random-weight checkpoints made locally
(``tiny_models``). Nothing in ``hooks/`` or ``plugin/`` imports it; the drafters' own ``tiny.py`` fixtures
build on it."""
