"""The decoding kit over the built-in strategies' token trees: a static draft-model tree,
an n-gram tree of three matches and a dynamic EAGLE-2 tree from an EAGLE-style head."""

from __future__ import annotations

from servelab.testing import DecodingConformance


class TestTreeDecodingStrategies(DecodingConformance):
    """decoding=speculative with a static tree, decoding=ngram with branches, decoding=eagle
    with a dynamic tree."""

    names = ("speculative", "ngram", "eagle")
    overrides = {"speculative": ("decoding.draft_path={checkpoint}", "decoding.tree=[[0],[1],[0,0],[0,1],[0,0,0]]"),
                 "ngram": ("decoding.branches=3",),
                 "eagle": ("decoding.tree_nodes=6", "decoding.tree_depth=3", "decoding.tree_top_k=2")}
