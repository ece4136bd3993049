"""The residency managers: one per memory tier (manager.py), the only owner of the models' copies there
(copy.py), of every hold on them and the lease table (holds.py), and of what leaves a tier (victims.py)."""

from .copy import HOST, ModelState, TierCopy
from .holds import PROFILE, REQUEST, SESSION, WORKER, Hold, Lease, LeaseTable
from .manager import Residency
from .victims import capacity_refusal, choose_victims

__all__ = ["HOST", "ModelState", "TierCopy", "Hold", "Lease", "LeaseTable", "PROFILE", "REQUEST", "SESSION", "WORKER",
           "Residency", "capacity_refusal", "choose_victims"]
