"""Datasets, samplers and iterators."""
