"""Helpers the test modules share, and the only place they come from.

No test module imports from another test module or from ``conftest.py`` (which holds pytest
fixtures and hooks only): what two test modules need lives here, by topic. What tests share
with the demo and the benchmarks (tiny models, corpora, launchers) is the shipped
:mod:`rapidformer.testing`. tests/test_layering.py checks both rules.
"""
