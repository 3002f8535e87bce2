"""The padding rules table: the rule the padding walk (padding_walk.py) applies to each ATen op, by the op's name.

Each op family's rules live in their own module, with the ops they cover (their ``RULES``): elementwise ops and
factories (padding_rules_elementwise.py), views and ops that move rows (padding_rules_views.py), reductions and norms
(padding_rules_reductions.py), matmuls, attention and convolutions (padding_rules_contractions.py), indexing
(padding_rules_indexing.py), collectives (padding_rules_collectives.py). What a rule receives and returns:
padding_rule_context.py. An op found in no table reads as mixing if it touches a padded value
(padding_rules_elementwise.no_rule).
"""
from __future__ import annotations

import torch

from .._torch import aten as torch_aten
from . import (padding_rules_collectives, padding_rules_contractions, padding_rules_elementwise, padding_rules_indexing,
               padding_rules_reductions, padding_rules_views)
from .padding_rule_context import Rule
from .padding_rules_elementwise import no_rule, pointwise

RULES: dict[str, Rule] = {
    **padding_rules_elementwise.RULES, **padding_rules_views.RULES, **padding_rules_reductions.RULES,
    **padding_rules_contractions.RULES, **padding_rules_indexing.RULES, **padding_rules_collectives.RULES,
}
"""Every rule by the functional name of its ATen op (``add``, not ``add_``; no overload)."""

UNDECLARED_WRITES = {name: ("running_mean", "running_var") for name in (
    "native_batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm", "batch_norm")}
"""Ops that write these arguments in training mode without their schema saying so."""


def rule_for(node: torch.fx.Node, functional: str) -> Rule:
    """The rule for ``node``'s ATen op (``functional``: its name without overload or in-place ``_``): the pointwise
    rule for an op tagged ``torch.Tag.pointwise``, else the table's, else :func:`no_rule`."""
    if torch.Tag.pointwise in torch_aten.aten_op(node).tags:
        return pointwise
    return RULES.get(functional, no_rule)
