"""0.3's home of :class:`Origin`: it lives in :mod:`lightning_amp_plus.forensics.origin` now (same class)."""

from lightning_amp_plus.forensics.origin import OWN_CODE, Origin, OwnCode, Phase, Verdict, unknown

__all__ = ["OWN_CODE", "Origin", "OwnCode", "Phase", "Verdict", "unknown"]
