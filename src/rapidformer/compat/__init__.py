"""Compatibility layers for scripts written against other tools' APIs.

:mod:`rapidformer.compat.pai` runs PAI-Rapidformer scripts with only their import line changed.
"""
