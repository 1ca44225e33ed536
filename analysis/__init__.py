"""Analysis of a sweep: ``result.json`` rows → tidy frames → the paper's tables and
figures. Entry points: :func:`analyze` (used by the sweep) and ``python -m analysis``."""
from .load import Sweep, describe, load_sweep
from .report import analyze

__all__ = ["Sweep", "analyze", "describe", "load_sweep"]
