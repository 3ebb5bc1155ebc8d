"""The end of a recorded step: the quantities collect their device values and the step's
values reach the host in one transfer (:mod:`.step_end`), those host values become rows
(:mod:`.host_rows`), and what the user is told about a step (:mod:`.checks`) or its arguments
(:mod:`.arguments`).

Imports the parts before it: numerics, discovery, capture, quantities.
"""
