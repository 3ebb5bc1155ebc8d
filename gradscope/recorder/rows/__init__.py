"""Where a recorded step's rows go: the queue that builds them off the training step
(:mod:`.late_rows`), and the outlet that adds the spike rows and hands them to memory and
to every :class:`~gradscope.sinks.Sink` (:mod:`.outlet`).

Imports the parts before it (quantities, for the spike rule) and :mod:`gradscope.sinks`.
"""
