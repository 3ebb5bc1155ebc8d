"""Spike replay (``Recorder(on_spike="replay")``): every step watched cheaply, a spiking one
recorded by running it again (:mod:`.replay`), and the Recorder's entry points that run a
step's closure (:mod:`.step_runner`).

Imports the parts below it.
"""
