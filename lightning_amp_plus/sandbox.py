"""0.3's path of the sandbox: it lives in :mod:`lightning_amp_plus.forensics.opt_in.sandbox` now (goes in 0.5).

``sandboxed`` takes ``(modules, device_type, start=None)`` there: the replayed modules, not what they reach.
``attempt`` lives in :mod:`lightning_amp_plus.forensics._safe` (the default path's).
"""

from lightning_amp_plus._warnings import moved

__getattr__ = moved(
    __name__,
    {"sandboxed": "lightning_amp_plus.forensics.opt_in.sandbox", "attempt": "lightning_amp_plus.forensics._safe"},
    "0.5",
)
