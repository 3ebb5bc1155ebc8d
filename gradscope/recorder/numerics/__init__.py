"""Exact reductions: ‖t‖² to a bound that holds on any CPU (:mod:`.squared_norms`), a
normalisation layer's statistics and the gradient through it alone (:mod:`.norm_stats`),
and the collectives that combine them over ranks (:mod:`.collectives`).

Imports nothing else of the recorder: every other part may use it.
"""
