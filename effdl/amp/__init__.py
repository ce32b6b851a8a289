"""Mixed precision from scratch: loss scalers and an autocast that do not use torch's own."""

from effdl.amp.autocast import Autocast
from effdl.amp.scaler import DynamicGradScaler, StaticGradScaler

__all__ = ["Autocast", "DynamicGradScaler", "StaticGradScaler"]
