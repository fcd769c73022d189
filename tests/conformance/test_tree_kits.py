"""The decoding kit over the built-in strategies' token trees: a static draft-model tree
and an n-gram tree of three matches (decoding=eagle drafts trees in every kit run:
its chain is the one-child tree; tests/e2e/test_eagle.py runs its dynamic and static trees)."""

from __future__ import annotations

from servelab.testing import DecodingConformance


class TestTreeDecodingStrategies(DecodingConformance):
    """decoding=speculative with a static tree, decoding=ngram with branches."""

    names = ("speculative", "ngram")
    overrides = {"speculative": ("decoding.draft_path={checkpoint}", "decoding.tree=[[0],[1],[0,0],[0,1],[0,0,0]]"),
                 "ngram": ("decoding.branches=3",)}
