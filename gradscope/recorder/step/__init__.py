"""One recorded step's end: the quantities' device values taken to the host in one transfer
(:mod:`.step_end`), those values turned into rows (:mod:`.finish`), and what the user is
told about the step (:mod:`.checks`, :mod:`.arguments`).

Imports the parts below it: numerics, discovery, capture, quantities.
"""
