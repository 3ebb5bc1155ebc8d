"""Where a recorded step's rows go: the queue that builds them off the training step
(:mod:`.late_rows`) and the outlet to memory, the spike rule and the sinks (:mod:`.outlet`).

Imports the parts below it (quantities for the spike rule) and :mod:`gradscope.sinks`.
"""
