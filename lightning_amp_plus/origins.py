"""0.3's path of :class:`OriginFinder`: it lives in :mod:`lightning_amp_plus.forensics.finder` now (goes in 0.5)."""

from lightning_amp_plus._warnings import moved

__getattr__ = moved(__name__, {"OriginFinder": "lightning_amp_plus.forensics.finder"}, "0.5")
