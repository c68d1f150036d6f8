"""Which PromQL queries must return data for a dashboard panel or a rule to
be backed by real series.

A rule's or panel's expression may legitimately return nothing on a healthy
server: an alert's condition (`ratio > 0.9`), a panel's `> 0` filter, an
`unless` that hides a replica. What must exist is the data the condition is
computed from. So each expression is taken apart with a PromQL parser
(promql-parser, PyPI) by these rules, and each resulting query must return
at least one sample:

- `a and b`, `a or b`, `a unless b`: a and b are checked separately;
- a comparison without `bool` (`a > b`, `a == 0`): a and b are checked
  separately, a number literal side is dropped;
- `( a )` is checked as a;
- an `offset` modifier is dropped: a test's server is only seconds old, so
  `avg_over_time(x[6h] offset 1h)` is checked as `avg_over_time(x[6h])`;
- anything else (a selector, a function call, an aggregation, arithmetic) is
  one query, kept whole.
"""
import re

import promql_parser

SET_OPS = {"and", "or", "unless"}
COMPARISONS = {"==", "!=", ">", "<", ">=", "<="}
_OFFSET = re.compile(r"\s+offset\s+-?[0-9smhdwy]+")


def _is_bool(expr):
    modifier = getattr(expr, "modifier", None)
    return bool(modifier is not None and getattr(modifier, "return_bool", False))


def _parts(expr):
    if isinstance(expr, promql_parser.ParenExpr):
        yield from _parts(expr.expr)
    elif isinstance(expr, promql_parser.BinaryExpr) and (
            str(expr.op) in SET_OPS or (str(expr.op) in COMPARISONS and not _is_bool(expr))):
        for side in (expr.lhs, expr.rhs):
            if not isinstance(side, promql_parser.NumberLiteral):
                yield from _parts(side)
    else:
        yield _OFFSET.sub("", str(expr))


def data_queries(expr):
    """The queries that must return data for `expr` (see the module doc)."""
    out = []
    for q in _parts(promql_parser.parse(expr)):
        if q not in out:
            out.append(q)
    return out
