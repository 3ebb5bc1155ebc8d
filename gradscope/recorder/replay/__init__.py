"""Spike replay (``Recorder(on_spike="replay")``): every step watched cheaply, and a spiking
step the schedule skips recorded by running it again (:mod:`.replay`).

Imports the parts before it; it drives a Recorder through the small protocol
:class:`.replay.Recording` rather than importing it.
"""
