"""Where a skipped update's inf/nan were born: observe (default) -> replay (opt-in, by name) -> verdict.

* :mod:`.observe`: what the step computed, read on a skip: the batch, the losses, and after the first skip whose loss
  held inf/nan a watch on every module (one device-side reduction per tensor a call takes or gives).
* :mod:`.replay` (``NaNSkipReporter(find_origin="replay")``) and :mod:`.rerun` (``backward_origin=True``,
  ``GradUnderflowMonitor(exact=True)``): run your code again, in :mod:`.sandbox`, to measure what observation cannot.
* :mod:`.verdict`: the one reading of what was observed into an :class:`~.origin.Origin`.

:class:`~.finder.OriginFinder` is the component ``NaNSkipReporter`` holds and ``AmpAdvisor`` reads. Nothing is
imported here (the walker in :mod:`._tree` is shared with the islands and the reports).
"""
