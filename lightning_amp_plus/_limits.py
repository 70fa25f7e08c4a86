"""Numeric limits shared by the torch-free readers (the plot command) and the argument checks."""

#: float32's largest finite value and smallest normal value: the range a device-side scale can hold
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0**-126
#: the device-side growth and hysteresis trackers are int32
INT32_MAX = 2**31 - 1
#: modules put in float32 one after the other, at most, to find the islands an overflow needs (then: bf16)
MAX_ISLANDS = 4
#: autograd nodes a walk of a step's graph reads at most. Torch crashes (SIGSEGV) freeing a graph whose
#: ``next_functions`` were read tens of thousands of nodes deep (measured: 20,000 of a 90,000-node chain freed fine,
#: 50,000 crashed, torch 2.13 on CPU); a walk stops well before, and says what it could not read
GRAPH_NODES = 10_000


def scale_floor(min_scale: float) -> float:
    """The lowest scale a scaler with ``min_scale`` reaches: ``min_scale=0`` still stops at float32's smallest normal.

    The one floor rule: the scaler backs off to it, and "the scale sits at its floor" is ``scale <= scale_floor(...)``
    everywhere (the collapse, the underflow warning, the advice).

    Example:
        >>> scale_floor(1.0), scale_floor(0.0) == 2.0**-126
        (1.0, True)
    """
    return max(min_scale, FLOAT32_TINY)
