"""0.4's path of the sandbox: it lives in :mod:`lightning_amp_plus.forensics.opt_in.sandbox` now (goes in 0.6).

``attempt`` and ``torch_own`` (the default path's) live in :mod:`lightning_amp_plus.forensics._safe`.
"""

from lightning_amp_plus._warnings import moved

__getattr__ = moved(
    __name__,
    {
        "sandboxed": "lightning_amp_plus.forensics.opt_in.sandbox",
        "attempt": "lightning_amp_plus.forensics._safe",
        "torch_own": "lightning_amp_plus.forensics._safe",
    },
    "0.6",
)
