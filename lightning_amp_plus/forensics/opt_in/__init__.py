"""The opt-ins: what runs your code again, loaded only when you ask for one by name.

- ``replay.py``: ``NaNSkipReporter(find_origin="replay")``: the named module's call again, in float32, for its
  verdict and islands.
- ``rerun.py``: ``NaNSkipReporter(backward_origin=True)`` and ``GradUnderflowMonitor(exact=True)``: the batch's
  ``training_step`` again.
- ``sandbox.py``: where they run: stand-in parameters and buffers, random streams given back, copied arguments.

Nothing of the default path imports them at the top of a file; a test checks a default fit loads none.
"""
